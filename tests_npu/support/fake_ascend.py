"""A fake /usr/local/Ascend holding the three CANN environment scripts of the base image.

The CANN base image's entrypoint sources, in this order: the toolkit's set_env.sh, AscendNPU IR's
($ASCEND_TOOLKIT_HOME/share/info/ascendnpu-ir/bin/set_env.sh) and ATB's with
`--cxx_abi=${ATB_CXX_ABI:-1}`. docker/entrypoint.sh and install.sh's chip step must do the same
(both through docker/cann-env.sh). Each fake script appends "<step> <arguments>" to $CANN_ENV_LOG,
exports a marker, and behaves like CANN's own: it reads an unset variable and ends on a failed test.
"""

from __future__ import annotations

from pathlib import Path

# The expected log: every script, in the base image's order, with ATB's argument (ATB_CXX_ABI unset).
SOURCED_IN_ORDER = ["toolkit", "ascendnpu-ir", "atb --cxx_abi=1"]
# What the base image's ENV sets before any script runs.
BASE_IMAGE_ENV = {"ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/cann-9.1.0", "ATB_CXX_ABI": "1"}


def make_fake_ascend(root: Path, missing: tuple[str, ...] = ()) -> dict[str, str]:
    """Create the fake tree (without the steps in ``missing``); returns the env that points at it."""
    toolkit_home = root / "cann-9.1.0"
    scripts = {
        "toolkit": (
            root / "ascend-toolkit" / "set_env.sh",
            f"export ASCEND_TOOLKIT_HOME={toolkit_home}\nexport FAKE_CANN_TOOLKIT=loaded\n",
        ),
        "ascendnpu-ir": (
            toolkit_home / "share" / "info" / "ascendnpu-ir" / "bin" / "set_env.sh",
            "export FAKE_CANN_ASCENDNPU_IR=loaded\n",
        ),
        "atb": (root / "nnal" / "atb" / "set_env.sh", 'export FAKE_CANN_ATB_ARGS="$*"\n'),
    }
    for step, (path, body) in scripts.items():
        if step in missing:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f'echo "{step}${{1:+ $*}}" >>"$CANN_ENV_LOG"\n{body}'
            ': "$A_VARIABLE_CANN_NEVER_SETS"\n'  # fails under `set -u`
            '[ -n "" ] && echo never\n'  # the script's status is 1, as CANN's can be
        )
    return {"ASCEND_ROOT": str(root), "CANN_ENV_LOG": str(root / "sourced.log")}


def sourced(env: dict[str, str]) -> list[str]:
    """The scripts that ran, in order (the log each fake script appends to)."""
    log = Path(env["CANN_ENV_LOG"])
    return log.read_text().splitlines() if log.is_file() else []
