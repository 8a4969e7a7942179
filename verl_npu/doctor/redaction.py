"""Secrets out of ``verl-npu doctor --report``: by a variable's name, and by the shape of any text it prints.

A report is pasted into public issues, so everything it prints from the environment or from files
goes through :func:`redact_text`; an environment variable whose name says secret shows no value at
all (:func:`redact`). What a maintainer needs to debug stays: a URL keeps its scheme, host, port,
path and harmless query parameters; a header or JSON key keeps its name; a recognised token keeps
its prefix (``hf_<redacted>``) so the reader knows what kind of credential was there.

Shapes recognised anywhere in the text:

- credentials in a URL (``scheme://user:pass@host``) and query or fragment parameters whose names
  look secret (``?token=``, ``&access_token=``, ``X-Amz-Signature=``, ``sig=``, ``key=``);
- ``NAME=value``, ``--name value``, ``Name: value`` (a header) where the name looks secret;
- JSON or Python-literal values under secret-looking keys (``{"Authorization": "..."}``), and the
  ``[["Authorization", "..."]]`` pair form Ray's ``RAY_PROMETHEUS_HEADERS`` also accepts;
- ``Bearer ...`` tokens, and ``Basic ...`` credentials (base64 of ``user:password``);
- PEM blocks of private keys (the body goes, the BEGIN/END lines stay);
- the token formats of well-known services (Hugging Face, GitHub, GitLab, AWS key ids, Slack,
  OpenAI-style ``sk-``, Google API keys, npm, PyPI) and JSON Web Tokens.
"""

from __future__ import annotations

import base64
import binascii
import re

REDACTED = "<redacted>"

# An environment variable whose name contains one of these never shows its value.
SECRET_VARIABLE = re.compile(r"TOKEN|SECRET|PASSW|PWD|KEY|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|CERT", re.I)
# Words that contain "token" and name no secret: a tokenizer's path and token counts stay readable.
_NOT_SECRET = re.compile(r"tokeni[sz](?:ers?|ed|ations?|e)?|(?:max|min|num|total)[_-]?(?:new[_-]?)?tokens", re.I)

# A key (query parameter, header, JSON key, option) is secret when one of its words is one of these ...
_SECRET_WORDS = frozenset(
    {"key", "pass", "pwd", "auth", "sig", "signature", "session", "sessionid", "jwt", "otp", "pat", "apikey"}
)
# ... or when it contains one of these anywhere (``hftoken``, ``X-Amz-Security-Token``, ``client_secret``).
_SECRET_PARTS = ("token", "secret", "passw", "credential", "apikey", "api_key", "privatekey", "private_key",
                 "accesskey", "access_key", "authorization", "cookie")  # fmt: skip


def is_secret_key(name: str) -> bool:
    """Whether a key (query parameter, header, JSON key, option, variable) names a secret."""
    name = _NOT_SECRET.sub("_", name)
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()  # accessToken -> access_token
    if any(part in spaced or part in name.lower() for part in _SECRET_PARTS):
        return True
    return any(word in _SECRET_WORDS for word in re.split(r"[^a-z0-9]+", spaced))


def is_secret_variable(name: str) -> bool:
    """Whether an environment variable's name says its value is secret."""
    return bool(SECRET_VARIABLE.search(_NOT_SECRET.sub("_", name))) or is_secret_key(name)


# --- the shapes ------------------------------------------------------------------------------------

# userinfo cannot hold '/', '?', '#' or '@': the host and port after it stay
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]{0,30}://)(?P<userinfo>[^/?#@\s|<>\"'`]+)@", re.I)
_PEM = re.compile(
    r"(?P<begin>-----BEGIN (?P<label>[A-Z0-9 ]+)-----)"
    r"(?P<body>(?:(?!-----END)(?:[A-Za-z0-9+/=:,.\s\\-]|<br>))*)"
    r"(?P<end>-----END [A-Z0-9 ]+-----)?"
)
# "key": "value" and 'key': 'value' (JSON, Python reprs); the value keeps its quotes
_QUOTED_PAIR = re.compile(
    r"(?P<q>[\"'])(?P<key>[^\"'\\\s]{1,100})(?P=q)(?P<sep>\s*:\s*)(?P<vq>[\"'])(?P<value>(?:\\.|(?!(?P=vq))[^\\\n])*)(?P=vq)"
)
# ["Authorization", "Bearer ..."]: the pair form of a header list
_QUOTED_LIST_PAIR = re.compile(
    r"(?P<open>\[\s*)(?P<q>[\"'])(?P<key>[^\"'\\\s]{1,100})(?P=q)(?P<sep>\s*,\s*)(?P<vq>[\"'])"
    r"(?P<value>(?:\\.|(?!(?P=vq))[^\\\n])*)(?P=vq)"
)
# NAME=value (a variable, a query or fragment parameter, a cookie, --name=value)
# (a value never takes the backslash of a Markdown cell's escaped pipe: the table stays whole)
_VALUE = r"(?P<value>\"[^\"]*\"|'[^']*'|(?:[^\s&;#|<>\"'`,)\\]|\\(?!\|))+)"
_ASSIGNMENT = re.compile(r"(?<![\w.-])(?P<key>-{0,2}[A-Za-z_][\w.-]*)(?P<sep>=)" + _VALUE)
# --name value (a command line held in a variable)
_OPTION = re.compile(r"(?<![\w.-])(?P<key>--?[A-Za-z][\w-]*)(?P<sep>[ \t]+)" + _VALUE)
# Header: value, to the end of the line or cell
_HEADER = re.compile(
    r"(?<![\w.-])(?P<key>[A-Za-z][\w-]*)(?P<sep>:[ \t]*)(?P<value>[^\s|<>\"'`\\](?:[^\n|<>\"'`\\]|\\(?!\|))*)"
)
_BEARER = re.compile(r"\b(?P<scheme>bearer)(?P<sep>\s+)(?P<value>[A-Za-z0-9._~+/=-]{6,})", re.I)
_BASIC = re.compile(r"\b(?P<scheme>basic)(?P<sep>\s+)(?P<value>[A-Za-z0-9+/]{4,}={0,2})(?![A-Za-z0-9+/=])", re.I)
# (prefix kept, the rest goes): the formats their issuers document
_KNOWN_TOKENS = [
    re.compile(r"\b(?P<prefix>hf_)[A-Za-z0-9]{20,}"),  # Hugging Face
    re.compile(r"\b(?P<prefix>gh[pousr]_)[A-Za-z0-9]{30,}"),  # GitHub
    re.compile(r"\b(?P<prefix>github_pat_)[A-Za-z0-9_]{20,}"),
    re.compile(r"\b(?P<prefix>glpat-)[A-Za-z0-9_-]{20,}"),  # GitLab
    re.compile(r"\b(?P<prefix>(?:AKIA|ASIA))[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\b(?P<prefix>xox[abposr]-)[A-Za-z0-9-]{10,}"),  # Slack
    re.compile(r"\b(?P<prefix>sk-)[A-Za-z0-9_-]{20,}"),  # OpenAI-style API keys
    re.compile(r"\b(?P<prefix>AIza)[0-9A-Za-z_-]{35}"),  # Google API key
    re.compile(r"\b(?P<prefix>npm_)[A-Za-z0-9]{36}"),  # npm
    re.compile(r"\b(?P<prefix>pypi-)[A-Za-z0-9_-]{50,}"),  # PyPI upload token
    re.compile(r"\b(?P<prefix>)eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"),  # JSON Web Token
]


def _keyed(match: re.Match) -> str:
    """The match with its value redacted when its key looks secret, else unchanged."""
    already = match.string.startswith(REDACTED, match.end())  # "Authorization: Bearer <redacted>"
    if already or not is_secret_key(match["key"].lstrip("-")) or match["value"].startswith(("<", '"<', "'<")):
        return match[0]
    value = match["value"]
    quote = value[0] if value[:1] in ("'", '"') and len(value) > 1 and value[-1] == value[0] else ""
    return match[0][: match.start("value") - match.start(0)] + f"{quote}{REDACTED}{quote}"


def _quoted(match: re.Match) -> str:
    if not is_secret_key(match["key"]) or REDACTED in match["value"]:  # "Bearer <redacted>" keeps its scheme
        return match[0]
    return match[0][: match.start("value") - match.start(0)] + REDACTED + match["vq"]


def _basic(match: re.Match) -> str:
    """Basic credentials are base64 of ``user:password``; any other word after "basic" is prose."""
    value = match["value"]
    try:
        decoded = base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        return match[0]
    return f"{match['scheme']}{match['sep']}{REDACTED}" if b":" in decoded else match[0]


def _pem(match: re.Match) -> str:
    if not match["body"].strip() or not any(word in match["label"] for word in ("PRIVATE", "SECRET", "ENCRYPTED")):
        return match[0]
    return f"{match['begin']}{REDACTED}{match['end'] or ''}"


def redact_text(text: str) -> str:
    """``text`` with every secret shape this module knows replaced by :data:`REDACTED`."""
    text = _PEM.sub(_pem, text)
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    text = _BEARER.sub(lambda m: f"{m['scheme']}{m['sep']}{REDACTED}", text)
    text = _BASIC.sub(_basic, text)
    text = _QUOTED_PAIR.sub(_quoted, text)
    text = _QUOTED_LIST_PAIR.sub(_quoted, text)
    text = _ASSIGNMENT.sub(_keyed, text)
    text = _OPTION.sub(_keyed, text)
    text = _HEADER.sub(_keyed, text)
    for pattern in _KNOWN_TOKENS:
        text = pattern.sub(lambda m: f"{m['prefix']}{REDACTED}", text)
    return text


def redact(name: str, value: str) -> str:
    """The value to show for an environment variable: none when its name says secret, else no secret shapes."""
    if is_secret_variable(name):
        return REDACTED
    return redact_text(value)
