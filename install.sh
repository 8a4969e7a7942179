#!/usr/bin/env bash
# install.sh - install the pinned verl-npu stack (verl_npu/stack/stack.toml) on one target.
#
#   bash install.sh [--target a2|a3|dev] [--prefix DIR] [--dry-run] [--dev]
#
# Targets: a2 / a3 install the Ascend stack into the current Python 3.12 (the CANN images' Python)
# and keep sources plus build-manifest.json under --prefix (default /opt/verl-npu); dev creates a
# Python 3.12 virtual environment at --prefix (default ./.venv). Without --target the target is
# $VERL_NPU_TARGET, else detected: an Ascend node (npu-smi) gives a2 or a3, anything else gives dev.
# Every step is idempotent: a second run finds everything in place and changes nothing.
# Exit: 0 installed (or planned); 1 a step failed; 2 a bad option or variable, nothing done.
set -Eeuo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VALID_TARGETS="a2 a3 dev"
TARGET=""
PREFIX=""
DRY_RUN=0
DEV_TOOLS=0
STEP="parse arguments"

log() { printf '[install.sh] %s\n' "$*"; }
warn() { printf '[install.sh] WARNING: %s\n' "$*" >&2; }
die() {
  printf '[install.sh] ERROR in step "%s": %s\n' "$STEP" "$*" >&2
  exit 1
}
bad_input() { # an option or variable install.sh cannot use: exit 2 before anything is touched (docs/errors.md)
  printf '[install.sh] ERROR in step "%s": %s\n' "$STEP" "$*" >&2
  exit 2
}
on_error() {
  local status=$1 line=$2
  printf '[install.sh] ERROR in step "%s": command at install.sh:%s exited with status %s\n' \
    "$STEP" "$line" "$status" >&2
}
trap 'on_error $? $LINENO' ERR

usage() {
  sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# A value given once and not empty: an empty `--target ''` or a second --target must not fall back to detection
# or to the last one given.
TARGET_GIVEN=0
PREFIX_GIVEN=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --target | --target=*)
      if [[ "$1" == --target ]]; then
        [[ $# -ge 2 && "$2" != --* ]] || bad_input "--target needs a value (one of: $VALID_TARGETS)"
        value="$2"; shift 2
      else
        value="${1#--target=}"; shift
      fi
      [[ "$TARGET_GIVEN" == 0 ]] || bad_input "--target is given twice ('$TARGET', then '$value'): give it once"
      [[ -n "$value" ]] || bad_input "--target is empty; valid targets: $VALID_TARGETS (or leave --target out to detect it)"
      TARGET="$value"; TARGET_GIVEN=1 ;;
    --prefix | --prefix=*)
      if [[ "$1" == --prefix ]]; then
        [[ $# -ge 2 && "$2" != --* ]] || bad_input "--prefix needs a directory"
        value="$2"; shift 2
      else
        value="${1#--prefix=}"; shift
      fi
      [[ "$PREFIX_GIVEN" == 0 ]] || bad_input "--prefix is given twice ('$PREFIX', then '$value'): give it once"
      [[ -n "$value" ]] || bad_input "--prefix is empty; give a directory (or leave --prefix out for the target's default)"
      PREFIX="$value"; PREFIX_GIVEN=1 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --dev) DEV_TOOLS=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bad_input "unknown argument '$1' (see: bash install.sh --help)" ;;
  esac
done

# --- target and Python -------------------------------------------------------------------------

STEP="detect target"
is_target() { [[ " $VALID_TARGETS " == *" $1 "* && "$1" != *" "* ]]; } # exactly one of them, case and all
if [[ -n "$TARGET" ]] && ! is_target "$TARGET"; then
  bad_input "unknown target '$TARGET'; valid targets: $VALID_TARGETS"
fi
# The runtime layer checks the installed stack against $VERL_NPU_TARGET (verl_npu/megatron_adaptor.py), empty
# meaning unset there as here. A value it would refuse stops the install now; a valid one is the target when
# --target is not given. The images set it, so a --target that differs (a dev venv inside an a3 image) is allowed.
ENV_TARGET="${VERL_NPU_TARGET:-}"
if [[ -n "$ENV_TARGET" ]]; then
  is_target "$ENV_TARGET" || bad_input "VERL_NPU_TARGET='$ENV_TARGET' is not a target; valid targets: $VALID_TARGETS (lower case), or unset it"
  if [[ -z "$TARGET" ]]; then
    TARGET="$ENV_TARGET"
    log "no --target given; target from VERL_NPU_TARGET: $TARGET"
  elif [[ "$TARGET" != "$ENV_TARGET" ]]; then
    warn "--target $TARGET differs from VERL_NPU_TARGET=$ENV_TARGET: with that variable set, the runtime layer checks the installed stack against $ENV_TARGET"
  fi
fi
# The digits are spelled out: a range such as [0-9] follows the locale's collation, where it may match more
# than the ten ASCII digits that `timeout` reads.
DETECT_TIMEOUT_S="${VERL_NPU_DETECT_TIMEOUT_S:-120}"
[[ "$DETECT_TIMEOUT_S" =~ ^[123456789][0123456789]{0,4}$ ]] ||
  bad_input "VERL_NPU_DETECT_TIMEOUT_S='$DETECT_TIMEOUT_S' is not a whole number of seconds from 1 to 99999 (ASCII digits)"

STEP="find Python"
# The manifest's Python version; read with a regex so that no Python is needed to find Python.
PY_VERSION="$(sed -n '/^\[python\]/,/^\[/s/^version *= *"\([0-9.]*\)".*/\1/p' "$REPO_ROOT/verl_npu/stack/stack.toml")"
[[ -n "$PY_VERSION" ]] || die "verl_npu/stack/stack.toml has no [python] version"

python_is_wanted() { [[ "$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "$PY_VERSION" ]]; }
find_python() {
  local candidate
  for candidate in "python$PY_VERSION" python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && python_is_wanted "$(command -v "$candidate")"; then
      command -v "$candidate"
      return 0
    fi
  done
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  if command -v pyenv >/dev/null 2>&1; then pyenv_root="$(pyenv root)"; fi
  for candidate in "$pyenv_root"/versions/"$PY_VERSION"*/bin/python"$PY_VERSION"; do
    if [[ -x "$candidate" ]] && python_is_wanted "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}
if ! BASE_PYTHON="$(find_python)"; then
  die "Python $PY_VERSION not found on PATH nor under pyenv (\$PYENV_ROOT/versions/$PY_VERSION*). Install it, e.g. 'pyenv install $PY_VERSION', or put python$PY_VERSION on PATH"
fi

STEP="detect target"
# One detector for install.sh, doctor and the runtime (verl_npu/stack/detect.py, standard library only).
# npu-smi is bounded inside (30 s, $VERL_NPU_PROBE_TIMEOUT_S); `timeout` bounds the whole detection as well, for
# a driver call that not even a killed process returns from.
if [[ -z "$TARGET" ]]; then
  BOUND=()
  if command -v timeout >/dev/null 2>&1; then
    BOUND=(timeout -k 10 "$DETECT_TIMEOUT_S")
  else
    warn "no 'timeout' command (coreutils): the target detection is bounded only by npu-smi's own 30 s limit"
  fi
  detect_status=0
  TARGET="$(cd "$REPO_ROOT" && "${BOUND[@]}" "$BASE_PYTHON" -m verl_npu.stack detect-target)" || detect_status=$?
  if [[ "$detect_status" == 2 ]]; then # a bad variable of the detection (VERL_NPU_PROBE_TIMEOUT_S), named above
    bad_input "the target detection refused its settings (message above); fix them, or pass --target (one of: $VALID_TARGETS)"
  elif [[ "$detect_status" == 124 || "$detect_status" == 137 ]]; then
    die "the target detection (npu-smi info) did not finish within ${DETECT_TIMEOUT_S} s and was stopped: the NPU driver does not answer (check 'npu-smi info' and dmesg); pass --target (one of: $VALID_TARGETS)"
  elif [[ "$detect_status" != 0 ]]; then
    die "the target could not be detected (message above); pass --target (one of: $VALID_TARGETS)"
  fi
  log "no --target given; detected target: $TARGET"
fi
if [[ -z "$PREFIX" ]]; then
  if [[ "$TARGET" == dev ]]; then PREFIX="$REPO_ROOT/.venv"; else PREFIX="/opt/verl-npu"; fi
fi

STEP="read manifest"
DEV_FLAG=()
[[ "$DEV_TOOLS" == 1 ]] && DEV_FLAG=(--dev)
PLAN="$(cd "$REPO_ROOT" && "$BASE_PYTHON" -m verl_npu.stack plan --target "$TARGET" "${DEV_FLAG[@]}")" ||
  die "the manifest verl_npu/stack/stack.toml could not be read (message above)"
CONSTRAINTS="$(cd "$REPO_ROOT" && "$BASE_PYTHON" -m verl_npu.stack constraints --target "$TARGET")"
ARCH="$(uname -m)"

# --- dry run: the ordered plan, nothing touched ------------------------------------------------

field() { # field KEY "k1=v1|k2=v2" -> value of KEY (empty when absent)
  local key=$1 rest=$2 item
  IFS='|' read -r -a items <<<"$rest"
  for item in "${items[@]}"; do
    if [[ "$item" == "$key="* ]]; then printf '%s' "${item#"$key="}"; return 0; fi
  done
  return 0
}

describe_step() { # describe_step N KIND NAME FIELDS
  local n=$1 kind=$2 name=$3 fields=$4 commit
  case "$kind" in
    python)
      if [[ "$TARGET" == dev ]]; then
        printf '%2d. python    create (or reuse) venv %s with %s (Python %s)\n' "$n" "$PREFIX" "$BASE_PYTHON" "$(field version "$fields")"
      else
        printf '%2d. python    use %s (Python %s)\n' "$n" "$BASE_PYTHON" "$(field version "$fields")"
      fi ;;
    chip) printf '%2d. chip      %s: CANN %s, SOC_VERSION=%s, base image %s\n' "$n" "$name" \
      "$(field cann_version "$fields")" "$(field soc_version "$fields")" "$(field base_image "$fields")" ;;
    pip)
      printf '%2d. pip       %s' "$n" "$(field requirement "$fields")"
      [[ -n "$(field index "$fields")" ]] && printf '  (index %s)' "$(field index "$fields")"
      [[ -n "$(field index_x86_64 "$fields")" && "$ARCH" == x86_64 ]] && printf '  (x86_64 index %s)' "$(field index_x86_64 "$fields")"
      [[ -n "$(field patches "$fields")" ]] && printf '  + patches %s' "$(field patches "$fields")"
      printf '\n' ;;
    git)
      commit="$(field commit "$fields")"
      if [[ "$commit" == UNVERIFIED ]]; then
        commit="UNVERIFIED (resolved from '$(field ref "$fields")' at build time, recorded in build-manifest.json)"
      fi
      printf '%2d. git       %-24s %s @ %s  commit %s  [install: %s]' "$n" "$name" "$(field url "$fields")" \
        "$(field ref "$fields")" "$commit" "$(field install "$fields")"
      [[ -n "$(field patches "$fields")" ]] && printf '  + patches %s' "$(field patches "$fields")"
      [[ "$(field build_isolation "$fields")" == false ]] &&
        printf '  [no build isolation: its build requirements first, except %s]' "$(field build_requires_skip "$fields" | tr ',' ' ')"
      printf '\n' ;;
    replace)
      printf '%2d. replace   %s' "$n" "$(field requirement "$fields")"
      [[ -n "$(field index "$fields")" ]] && printf '  (index %s)' "$(field index "$fields")"
      printf ': uninstall %s if installed (same import directory), then reinstall %s (forced, no deps)\n' \
        "$(field remove "$fields" | tr ',' ' ')" "$name" ;;
    local) printf '%2d. local     verl-npu from %s%s\n' "$n" "$REPO_ROOT" \
      "$([[ -n "$(field extras "$fields")" ]] && printf ' with extras [%s]' "$(field extras "$fields")")" ;;
    contracts) printf '%2d. contracts verl-npu contracts verify (MindSpeed, vllm-ascend, torch-npu as installed)\n' "$n" ;;
    build-manifest) printf '%2d. manifest  write %s/build-manifest.json (resolved commits, versions, date)\n' "$n" "$PREFIX" ;;
    *) die "the plan has an unknown step kind '$kind'" ;;
  esac
}

print_plan() {
  local n=0 kind name rest
  log "plan for target '$TARGET' (prefix $PREFIX, arch $ARCH):"
  while IFS='|' read -r kind name rest; do
    n=$((n + 1))
    describe_step "$n" "$kind" "$name" "$rest"
  done <<<"$PLAN"
  log "pip constraints applied to every install: $(tr '\n' ' ' <<<"$CONSTRAINTS")"
}

if [[ "$DRY_RUN" == 1 ]]; then
  print_plan
  log "dry run: nothing was installed or changed"
  exit 0
fi

# --- execution ---------------------------------------------------------------------------------

print_plan
mkdir -p "$PREFIX"
SRC_DIR="$PREFIX/src"
RESOLVED_FILE="$PREFIX/.resolved-commits"
CONSTRAINTS_FILE="$PREFIX/constraints.txt"
PY=""

pip_install() { "$PY" -m pip install --disable-pip-version-check -c "$CONSTRAINTS_FILE" "$@"; }
installed_version() { # prints the installed version of a distribution, or nothing
  "$PY" -I -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}
same_version() { [[ "${1%%+*}" == "${2%%+*}" ]]; } # ignore local labels such as +cpu
record_resolved() { # record_resolved NAME COMMIT (one line per component, newest wins)
  local tmp="$RESOLVED_FILE.tmp.$$"
  { grep -v "^$1 " "$RESOLVED_FILE" 2>/dev/null || true; echo "$1 $2"; } >"$tmp"
  mv "$tmp" "$RESOLVED_FILE"
}
git_nodiscover() { GIT_CEILING_DIRECTORIES="$(dirname "$1")" git -C "$1" "${@:2}"; }

run_python_step() {
  local version=$1
  if [[ "$TARGET" == dev ]]; then
    if [[ -x "$PREFIX/bin/python" ]]; then
      python_is_wanted "$PREFIX/bin/python" ||
        die "$PREFIX exists but is not a Python $version venv; remove it or pass another --prefix"
      log "venv $PREFIX already exists (Python $version)"
    else
      "$BASE_PYTHON" -m venv "$PREFIX"
      log "created venv $PREFIX"
    fi
    PY="$PREFIX/bin/python"
  else
    PY="$BASE_PYTHON"
  fi
  printf '%s\n' "$CONSTRAINTS" >"$CONSTRAINTS_FILE.tmp" && mv "$CONSTRAINTS_FILE.tmp" "$CONSTRAINTS_FILE"
}

run_chip_step() {
  local soc=$1 toolkit
  export SOC_VERSION="$soc"
  # The build needs the environment every container gets from docker/entrypoint.sh (the same three
  # scripts, in order), whatever ASCEND_TOOLKIT_HOME says: the base image sets that variable, but
  # not the toolkit's library paths, AscendNPU IR's compiler nor ATB's.
  # shellcheck source=docker/cann-env.sh
  source "$REPO_ROOT/docker/cann-env.sh"
  toolkit="$(cann_env_script toolkit)"
  [[ -f "$toolkit" ]] ||
    die "CANN not found ($toolkit); build on the manifest's CANN base image or install CANN first"
  cann_env_load "[install.sh]"
  log "CANN environment: ASCEND_TOOLKIT_HOME=${ASCEND_TOOLKIT_HOME:-unset}, SOC_VERSION=$SOC_VERSION"
  local script
  for script in "${CANN_ENV_SOURCED[@]}"; do log "  sourced $script"; done
}

apply_patches() { # apply_patches DIR PATCH... (git apply --check first, then apply)
  local dir=$1 patch
  shift
  for patch in "$@"; do
    if git_nodiscover "$dir" apply --reverse --check "$REPO_ROOT/$patch" 2>/dev/null; then
      log "patch $patch already applied in $dir"
      continue
    fi
    git_nodiscover "$dir" apply --check "$REPO_ROOT/$patch" ||
      die "patch $patch does not apply to $dir: the pinned source changed; refresh the patch"
    git_nodiscover "$dir" apply "$REPO_ROOT/$patch"
    log "applied $patch"
  done
}

INDEX_ARGS=()
set_index_args() { # set_index_args FIELDS: INDEX_ARGS = pip's index options for a pip or replace step
  local index index_x86
  index="$(field index "$1")"
  index_x86="$(field index_x86_64 "$1")"
  INDEX_ARGS=()
  [[ -n "$index" ]] && INDEX_ARGS+=(--extra-index-url "$index")
  [[ -n "$index_x86" && "$ARCH" == x86_64 ]] && INDEX_ARGS+=(--index-url "$index_x86" --extra-index-url https://pypi.org/simple)
  return 0
}

run_pip_step() {
  local name=$1 fields=$2 requirement version have patch_list
  requirement="$(field requirement "$fields")"
  version="${requirement#*==}"
  patch_list="$(field patches "$fields")"
  have="$(installed_version "$name")"
  set_index_args "$fields"
  local -a index_args=("${INDEX_ARGS[@]}")

  if [[ -z "$patch_list" ]]; then
    if [[ -n "$have" ]] && same_version "$have" "$version"; then
      log "$name $have already installed"
      return
    fi
    pip_install "${index_args[@]}" "$requirement"
    return
  fi

  # Patched package: build from its sdist with our patches applied (never edit site-packages).
  local -a patches
  IFS=',' read -r -a patches <<<"$patch_list"
  local site
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [[ -n "$have" ]] && same_version "$have" "$version"; then
    local all_applied=1 patch
    for patch in "${patches[@]}"; do
      git_nodiscover "$site" apply --reverse --check "$REPO_ROOT/$patch" 2>/dev/null || all_applied=0
    done
    if [[ "$all_applied" == 1 ]]; then
      log "$name $have already installed with its patches"
      return
    fi
  fi
  local dl="$SRC_DIR/sdist" tree="$SRC_DIR/$name-$version"
  mkdir -p "$dl"
  "$PY" -m pip download --disable-pip-version-check --no-deps --no-binary :all: "${index_args[@]}" -d "$dl" "$requirement"
  rm -rf "$tree"
  mkdir -p "$tree"
  local archive
  archive="$(find "$dl" -maxdepth 1 -iname "${name//-/[-_]}-$version.tar.gz" | head -n 1)"
  [[ -n "$archive" ]] || die "no sdist of $requirement was downloaded into $dl"
  tar --no-same-owner -xzf "$archive" -C "$tree" --strip-components=1
  apply_patches "$tree" "${patches[@]}"
  pip_install "${index_args[@]}" "$tree"
}

fetch_pinned_commit() { # fetch_pinned_commit NAME DIR URL REF COMMIT: DIR becomes a checkout of COMMIT from URL
  local name=$1 dir=$2 url=$3 ref=$4 commit=$5 tag tagged
  rm -rf "$dir"
  mkdir -p "$dir"
  git_nodiscover "$dir" init -q
  git_nodiscover "$dir" remote add origin "$url"
  # A version computed by setuptools-scm (vLLM's, vllm-ascend's) comes from the tag on the checked-out
  # commit; without it the checkout reports 0.1.devN. So when REF is a tag it is fetched too, and it
  # must be the pinned commit.
  tag="$(git_nodiscover "$dir" ls-remote origin "refs/tags/$ref")" ||
    die "git ls-remote $url failed: cannot tell whether '$ref' is a tag"
  if ! git_nodiscover "$dir" fetch -q --depth 1 origin "$commit"; then
    log "$name: the server refused a fetch by commit; fetching '$ref' instead"
    git_nodiscover "$dir" fetch -q origin "+refs/heads/$ref:refs/remotes/origin/$ref" "+refs/tags/$ref:refs/tags/$ref" ||
      git_nodiscover "$dir" fetch -q origin
  fi
  if [[ -n "$tag" ]]; then
    git_nodiscover "$dir" fetch -q --depth 1 origin "+refs/tags/$ref:refs/tags/$ref"
    tagged="$(git_nodiscover "$dir" rev-parse "refs/tags/$ref^{commit}")"
    [[ "$tagged" == "$commit" ]] ||
      die "$name: tag '$ref' of $url is commit $tagged, but verl_npu/stack/stack.toml pins $commit; review which one is meant and fix [git.$name] commit or ref"
  fi
  git_nodiscover "$dir" -c advice.detachedHead=false checkout -q --detach "$commit"
  echo "$url $ref $commit" >"$dir/.git/verl-npu-fetched"
}

install_build_requirements() { # install_build_requirements NAME DIR SKIP: for a build without isolation
  # What an isolated build would install, from the checkout's pyproject.toml [build-system] requires,
  # except SKIP (comma-separated; the stack provides torch), under the stack's constraints.
  local name=$1 dir=$2 skip=$3 listed
  local -a requirements=()
  listed="$(cd "$REPO_ROOT" && "$BASE_PYTHON" -m verl_npu.stack build-requires "$dir/pyproject.toml" --skip "$skip")" ||
    die "$name: its build requirements could not be read (message above)"
  [[ -z "$listed" ]] || mapfile -t requirements <<<"$listed"
  log "$name: built without build isolation; its build requirements except ${skip//,/ }: ${requirements[*]:-none}"
  [[ ${#requirements[@]} -eq 0 ]] || pip_install "${requirements[@]}"
}

run_git_step() {
  local name=$1 fields=$2 url ref commit install version dir head
  url="$(field url "$fields")"
  ref="$(field ref "$fields")"
  commit="$(field commit "$fields")"
  install="$(field install "$fields")"
  version="$(field version "$fields")"
  dir="$SRC_DIR/$name"

  if [[ "$commit" == UNVERIFIED ]]; then
    if [[ -d "$dir/.git" ]] && grep -q "^$name " "$RESOLVED_FILE" 2>/dev/null; then
      commit="$(sed -n "s/^$name //p" "$RESOLVED_FILE")"
      warn "$name: manifest commit is UNVERIFIED; reusing $commit resolved from '$ref' by an earlier run"
    else
      local remote
      remote="$(git ls-remote "$url" "refs/tags/$ref^{}" "refs/tags/$ref" "refs/heads/$ref")" ||
        die "git ls-remote $url failed: cannot resolve '$ref'"
      commit="$(awk 'NR==1 {print $1}' <<<"$(sort -r -k2 <<<"$remote")")"
      [[ "$commit" =~ ^[0-9a-f]{40}$ ]] || die "'$ref' does not exist in $url"
      warn "************************************************************************"
      warn "$name: manifest commit is UNVERIFIED; '$ref' resolved to $commit NOW."
      warn "Review it and pin it in verl_npu/stack/stack.toml; recorded in build-manifest.json."
      warn "************************************************************************"
    fi
  fi

  if [[ -d "$dir/.git" && "$(cat "$dir/.git/verl-npu-fetched" 2>/dev/null)" == "$url $ref $commit" ]]; then
    head="$(git_nodiscover "$dir" rev-parse HEAD 2>/dev/null || true)"
  else
    head="" # absent, or fetched by an older install.sh that did not fetch the tag
  fi
  if [[ "$head" != "$commit" ]]; then
    fetch_pinned_commit "$name" "$dir" "$url" "$ref" "$commit"
    head="$(git_nodiscover "$dir" rev-parse HEAD)"
  fi
  [[ "$head" == "$commit" ]] || die "$name: checked out $head but the pin is $commit"
  record_resolved "$name" "$commit"

  local -a patches=()
  [[ -z "$(field patches "$fields")" ]] || IFS=',' read -r -a patches <<<"$(field patches "$fields")"
  local stamp="$dir/.git/verl-npu-installed" want="$commit"
  if [[ ${#patches[@]} -gt 0 ]]; then # a changed patch reinstalls the component
    want="$commit patches $(cat "${patches[@]/#/$REPO_ROOT/}" | sha256sum | cut -d' ' -f1)"
  fi
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    log "$name $commit already installed$([[ ${#patches[@]} -eq 0 ]] || printf ' with its patches')"
    return
  fi
  # Install exactly the pinned commit plus our patches (an earlier, failed run may have left edits).
  git_nodiscover "$dir" reset -q --hard "$commit"
  [[ ${#patches[@]} -eq 0 ]] || apply_patches "$dir" "${patches[@]}"
  local -a build_args=()
  if [[ "$(field build_isolation "$fields")" == false ]]; then
    install_build_requirements "$name" "$dir" "$(field build_requires_skip "$fields")"
    build_args=(--no-build-isolation)
  fi
  case "$install" in
    pip) pip_install "${build_args[@]}" -e "$dir" ;;
    vllm-empty-device) VLLM_TARGET_DEVICE=empty pip_install "${build_args[@]}" -e "$dir" ;;
    vllm-ascend)
      pip_install -r "$dir/requirements.txt"
      COMPILE_CUSTOM_KERNELS=1 pip_install --no-build-isolation --no-deps -e "$dir" ;;
    *) die "$name: unknown install kind '$install'" ;;
  esac
  if [[ -n "$version" ]]; then
    local dist=$name have
    [[ "$name" == megatron-lm ]] && dist=megatron-core
    have="$(installed_version "$dist")"
    same_version "$have" "$version" || die "$name at $commit installed $dist '$have', the manifest expects $version"
  fi
  echo "$want" >"$stamp"
}

dist_intact() { # dist_intact NAME: installed, and every file its RECORD lists is present
  # (RECORD itself: Distribution.files leaves out the files that are missing.)
  "$PY" -I - "$1" <<'PYEOF'
import csv, importlib.metadata as m, sys
try:
    dist = m.distribution(sys.argv[1])
except m.PackageNotFoundError:
    sys.exit(1)
paths = [row[0] for row in csv.reader((dist.read_text("RECORD") or "").splitlines()) if row]
sys.exit(0 if paths and all(dist.locate_file(p).exists() for p in paths) else 1)
PYEOF
}

run_replace_step() { # the package owns its import directory again: what shares it is removed first
  local name=$1 fields=$2 requirement version have dist
  local -a remove present=()
  requirement="$(field requirement "$fields")"
  version="${requirement#*==}"
  IFS=',' read -r -a remove <<<"$(field remove "$fields")"
  for dist in "${remove[@]}"; do
    [[ -z "$(installed_version "$dist")" ]] || present+=("$dist")
  done
  have="$(installed_version "$name")"
  if [[ ${#present[@]} -eq 0 && -n "$have" ]] && same_version "$have" "$version" && dist_intact "$name"; then
    log "$name $have already installed with all its files (no ${remove[*]} installed)"
    return
  fi
  if [[ ${#present[@]} -gt 0 ]]; then
    log "uninstalling ${present[*]}: it installs the same import directory as $name"
    "$PY" -m pip uninstall --disable-pip-version-check -y "${present[@]}"
  fi
  set_index_args "$fields"
  pip_install "${INDEX_ARGS[@]}" --force-reinstall --no-deps "$requirement"
}

run_local_step() {
  local extras=$1 target="$REPO_ROOT" stamp="$PREFIX/.verl-npu-local" want
  [[ -n "$extras" ]] && target="${REPO_ROOT}[$extras]"
  want="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1) $REPO_ROOT [$extras]"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && editable_from_repo; then
    log "verl-npu already installed in editable mode from $REPO_ROOT [$extras]"
    return
  fi
  pip_install -e "$target"
  echo "$want" >"$stamp"
}
editable_from_repo() {
  "$PY" -I - "$REPO_ROOT" <<'PYEOF'
import importlib.metadata as m, json, pathlib, sys
try:
    dist = m.distribution("verl-npu")
except m.PackageNotFoundError:
    sys.exit(1)
url = json.loads(dist.read_text("direct_url.json") or "{}")
editable = url.get("dir_info", {}).get("editable", False)
sys.exit(0 if editable and url.get("url") == pathlib.Path(sys.argv[1]).as_uri() else 1)
PYEOF
}

run_contracts_step() {
  # The composed checks load verl-npu's runtime layer over the installed MindSpeed; before build-manifest.json is
  # written the layer learns the target from VERL_NPU_TARGET (it checks the installed versions against it).
  VERL_NPU_TARGET="$TARGET" "$PY" -m verl_npu.cli contracts verify ||
    die "the installed MindSpeed / vllm-ascend / torch-npu no longer hold the facts verl-npu relies on, alone or composed (table above); review the upstream change against docs/ascend_contracts.md before pinning it"
}

run_build_manifest_step() {
  "$PY" -m verl_npu.stack.build_manifest write --target "$TARGET" --prefix "$PREFIX" --resolved "$RESOLVED_FILE"
}

N=0
while IFS='|' read -r KIND NAME REST; do
  N=$((N + 1))
  STEP="$N. $KIND $NAME"
  log "--- step $STEP"
  case "$KIND" in
    python) run_python_step "$(field version "$REST")" ;;
    chip) run_chip_step "$(field soc_version "$REST")" ;;
    pip) run_pip_step "$NAME" "$REST" ;;
    git) run_git_step "$NAME" "$REST" ;;
    replace) run_replace_step "$NAME" "$REST" ;;
    local) run_local_step "$(field extras "$REST")" ;;
    contracts) run_contracts_step ;;
    build-manifest) run_build_manifest_step ;;
    *) die "the plan has an unknown step kind '$KIND'" ;;
  esac
done <<<"$PLAN"

STEP="done"
log "target $TARGET installed; build manifest: $PREFIX/build-manifest.json"
if [[ "$TARGET" == dev ]]; then
  log "activate with: source $PREFIX/bin/activate"
fi
