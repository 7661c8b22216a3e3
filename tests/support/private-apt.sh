# shellcheck shell=bash # sourced by bash scripts, so no shebang
# Sourced, not run: apt against one Debian suite with a private state dir, so that the system's
# apt lists are never touched and nothing is installed system-wide. The mirror is this machine's
# own (debian-mirror.sh).
#
#   . tests/support/private-apt.sh
#   private_apt_init sid "$cache"          # sets the array apt_opts; index refreshed at most daily
#   version=$(private_apt_candidate kubectl)
#   private_apt_download "$dir" kubectl    # the .deb files into $dir (emptied first)
#
# Functions return non-zero with a message on stderr; the caller decides how to fail.
. "$(dirname "${BASH_SOURCE[0]}")/debian-mirror.sh"

PRIVATE_APT_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

private_apt_init() { # SUITE CACHE_DIR
    local suite=$1 cache=$2 mirror stamp
    command -v apt-get >/dev/null || { echo "private-apt: apt-get not found: this needs a Debian machine" >&2; return 1; }
    command -v dpkg-deb >/dev/null || { echo "private-apt: dpkg-deb not found" >&2; return 1; }
    [ -r "$PRIVATE_APT_KEYRING" ] || { echo "private-apt: $PRIVATE_APT_KEYRING missing: install debian-archive-keyring" >&2; return 1; }
    mirror=$(debian_mirror) || return 1
    private_apt_dir="$cache/apt/$suite"
    mkdir -p "$private_apt_dir/lists/partial" "$private_apt_dir/archives/partial"
    echo "deb [signed-by=$PRIVATE_APT_KEYRING] $mirror $suite main" >"$private_apt_dir/sources.list"
    apt_opts=(
        -o "Dir::State=$private_apt_dir" -o "Dir::State::Lists=$private_apt_dir/lists" -o "Dir::State::status=/dev/null"
        -o "Dir::Cache=$private_apt_dir" -o "Dir::Cache::archives=$private_apt_dir/archives"
        -o "Dir::Etc::SourceList=$private_apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "APT::Architecture=$(dpkg --print-architecture)" -o "Acquire::Languages=none"
        -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
        -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root"
    )
    # sid moves, but not within a CI run: refresh the index at most daily.
    stamp="$private_apt_dir/lists/.updated"
    if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +1440)" ]; then
        apt-get "${apt_opts[@]}" -qq update || { echo "private-apt: apt-get update failed for suite $suite at $mirror" >&2; return 1; }
        touch "$stamp"
    fi
}

private_apt_candidate() { # PACKAGE: its candidate version in the suite, or fails
    local version
    version=$(apt-cache "${apt_opts[@]}" policy "$1" | awk '/Candidate:/ { print $2 }')
    if [ -z "$version" ] || [ "$version" = "(none)" ]; then
        echo "private-apt: the suite has no package $1" >&2
        return 1
    fi
    echo "$version"
}

private_apt_download() { # DIR PACKAGE...: the packages' .deb files into DIR (emptied first)
    local dir=$1
    shift
    mkdir -p "$dir" && rm -f "$dir"/*.deb
    (cd "$dir" && apt-get "${apt_opts[@]}" -qq download "$@") || { echo "private-apt: apt-get download $* failed" >&2; return 1; }
}
