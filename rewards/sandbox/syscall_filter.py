"""The seccomp filter of every sandbox: which system calls a tool may not make, compiled to BPF by libseccomp.

Default allow, with a deny list of what a tool never needs and what opens the kernel's attack surface:
namespace creation and entry (`unshare`, `setns`, the CLONE_NEW* flags of `clone`), the mount family,
process inspection (`ptrace`, `process_vm_*`), kernel keyrings, `bpf`, `perf_event_open`, `kexec_*`,
module loading, `io_uring_*`, `userfaultfd`, `personality` changes, and memory that no per-process limit
counts (`memfd_create`, `shmget`). Denied calls fail with EPERM,
as an unprivileged process expects; `clone3` fails with ENOSYS, because its flags sit in a struct the
filter cannot read, and libc then falls back to `clone`, whose flags it can. A system call of another
ABI (i386 `int 0x80`, x32) kills the process: the list names native calls only.

bubblewrap loads the program (`--seccomp FD`) after it has set up the namespaces and mounts, just before
it executes the tool, so the filter binds the tool and everything it starts.
"""
from __future__ import annotations

import errno
import os

# Flags of clone(2) that create a namespace (CLONE_NEWTIME shares its bit with the exit signal in clone,
# and is reachable only through unshare, which is denied whole).
CLONE_NEW_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
PERSONALITY_QUERY = 0xFFFFFFFF  # personality(0xffffffff) reads the persona without changing it

DENIED = (
    # namespaces and the mount table
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # other processes' memory and state
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel facilities a tool never needs, each a source of kernel bugs
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "userfaultfd", "open_by_handle_at", "name_to_handle_at", "acct", "quotactl", "swapon", "swapoff",
    "reboot", "syslog", "lookup_dcookie", "uselib", "vhangup",
    # memory no per-process limit counts: memfd pages and System V segments outlive the mappings that
    # RLIMIT_AS bounds (filled 96 at a time, one call pinned 3 GiB of a host's memory under a 256 MiB limit)
    "memfd_create", "shmget",
)


class FilterUnavailable(RuntimeError):
    """libseccomp or its Python binding is missing, or the filter cannot be built on this architecture."""


def build_filter() -> bytes:
    """The BPF program (struct sock_filter[]) that bubblewrap's --seccomp reads."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError) as exc:  # pyseccomp raises RuntimeError when libseccomp is absent
        raise FilterUnavailable(f"libseccomp binding unavailable ({exc}): install libseccomp2 "
                                "(apt-get install libseccomp2) and the pyseccomp package") from None
    f = sc.SyscallFilter(sc.ALLOW)
    try:
        for name in DENIED:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        for bit in CLONE_NEW_FLAGS.values():  # one rule per flag: a rule may test an argument only once
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        f.add_rule(sc.ERRNO(errno.EPERM), "personality", sc.Arg(0, sc.LT, PERSONALITY_QUERY))
        f.add_rule(sc.ERRNO(errno.EPERM), "personality", sc.Arg(0, sc.GT, PERSONALITY_QUERY))
    except (OSError, ValueError) as exc:
        raise FilterUnavailable(f"libseccomp cannot build the filter here: {exc}") from None
    with os.fdopen(os.memfd_create("seccomp-bpf"), "w+b") as out:
        f.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8 or len(program) > 4096 * 8:  # struct sock_filter: 8 bytes; BPF_MAXINSNS 4096
        raise FilterUnavailable(f"libseccomp exported a malformed program ({len(program)} bytes)")
    return program


def program_fd(program: bytes) -> int:
    """A fresh read end holding `program` for one bubblewrap start (bwrap reads --seccomp FD to its end).

    A pipe holds 64 KiB without a reader, far above the program's size (under 1 KiB), so writing never blocks.
    """
    if len(program) >= 65536:
        raise ValueError(f"seccomp program of {len(program)} bytes does not fit a pipe buffer")
    r, w = os.pipe()
    try:
        os.write(w, program)
    finally:
        os.close(w)
    return r
