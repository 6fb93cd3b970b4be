"""The filesystem a sandbox sees: an empty read-only root holding read-only binds of what tools need.

    /usr/bin, /usr/lib, /usr/lib64   the distribution's commands and shared libraries (read-only)
    /bin, /lib, /lib64, ...          as on the host: symlinks into /usr (merged /usr) or read-only binds
    /etc/ld.so.*                     the dynamic loader's configuration; nothing else of /etc
    PREFIX                           the tool interpreter's installation (binary, standard library,
                                     libpython), its site-packages replaced by an empty directory
    /proc                            a fresh procfs of the sandbox's own pid namespace
    /dev                             null, zero, full, random, urandom, tty, pts (bubblewrap's --dev)
    /tmp                             a private tmpfs of Limits.tmp_bytes, the only writable place

Not there: the rest of /etc (/etc/shadow, /etc/passwd), /home, /root, /run and its sockets, /var,
/sys, /usr/local, the host's /tmp, the project tree, run directories. A path the caller names as
hidden (the service's state directory, the project source, its virtual environment, home directories)
that lies inside one of the binds is covered by an empty tmpfs.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

SYSTEM_DIRS = ("/usr/bin", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
TOP_LEVEL = ("/bin", "/lib", "/lib64", "/lib32", "/libx32")  # symlinks into /usr on a merged-/usr system
LOADER_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def interpreter_prefix(python: str) -> Path:
    """The installation that `python` (a real path, not a virtual environment's link) belongs to."""
    exe = Path(os.path.realpath(python))
    for prefix in (Path(sysconfig.get_config_var("base") or "/"), Path(sysconfig.get_config_var("installed_base") or "/")):
        if prefix != Path("/") and _inside(exe, prefix):
            return prefix.resolve()
    return exe.parent.parent  # PREFIX/bin/pythonX.Y


def _scheme(prefix: Path) -> dict[str, str]:
    return sysconfig.get_paths(vars={"base": str(prefix), "platbase": str(prefix),
                                     "installed_base": str(prefix), "installed_platbase": str(prefix)})


def site_dirs(prefix: Path) -> list[Path]:
    """The installation's third-party package directories: masked, the tools run `python -I -S`."""
    paths = _scheme(prefix)
    return sorted({Path(paths[k]) for k in ("purelib", "platlib") if Path(paths[k]).is_dir()})


def mount_args(python: str, tmp_bytes: int, hidden: list[Path] = ()) -> list[str]:
    """bubblewrap arguments that build the view for a tool run by `python` (and any command in /usr/bin)."""
    args: list[str] = []
    binds: list[Path] = []
    made: set[Path] = {Path("/")}

    def bind(path: str | Path) -> None:
        path = Path(path)
        for anc in reversed(path.parents):  # bwrap would create them 0700: closed once the tool dropped root
            if anc not in made:
                args.extend(["--perms", "0755", "--dir", str(anc)])
                made.add(anc)
        args.extend(["--ro-bind", str(path), str(path)])
        binds.append(path)

    for d in SYSTEM_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            bind(d)
    for d in TOP_LEVEL:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            bind(d)
    for f in LOADER_FILES:
        if os.path.exists(f):
            bind(f)
    prefix = interpreter_prefix(python)
    needed = (Path(os.path.realpath(python)), Path(_scheme(prefix)["stdlib"]))
    if not all(any(_inside(p, b) for b in binds) for p in needed):
        bind(prefix)
    masks = [*site_dirs(prefix), *(Path(p).resolve() for p in hidden)]
    covered: list[Path] = []
    for path in sorted(set(masks), key=lambda p: len(p.parts)):
        if path.is_dir() and any(_inside(path, b) for b in binds) and not any(_inside(path, c) for c in covered):
            args += ["--perms", "0755", "--tmpfs", str(path)]
            covered.append(path)
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
             "--remount-ro", "/"]
    return args
