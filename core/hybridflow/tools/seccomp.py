"""The syscall filter of the tool sandbox: a seccomp-BPF program, compiled by libseccomp, that makes the syscalls a
tool never needs fail with ``EPERM``.

libseccomp (``libseccomp.so.2``, Debian's ``libseccomp2``: apt and systemd depend on it) resolves syscall names for
the running architecture, adds the architecture check and the x32-ABI guard, and writes the BPF program that
bubblewrap's ``--seccomp FD`` loads as the sandboxed process's last step before it runs the interpreter. This module
is the ctypes glue only; it knows nothing of bubblewrap (:mod:`hybridflow.tools.isolation`). Stability: developer.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import tempfile

__all__ = ["DENIED_SYSCALLS", "SeccompUnavailable", "compile_seccomp_filter", "filter_pipe"]

#: what a tool never needs: debugging or reading other processes, (un)mounting and namespaces, kernel keys, BPF,
#: kernel modules, perf, io_uring (its operations bypass the filter), clocks, reboot and the like. Names libseccomp
#: does not know on this architecture are skipped (e.g. ``iopl`` outside x86).
DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "syslog", "vhangup", "iopl", "ioperm", "personality", "uselib",
    "lookup_dcookie", "nfsservctl", "_sysctl",
)

_ALLOW = 0x7FFF0000
_ERRNO_EPERM = 0x00050000 | errno.EPERM


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or refused to build the filter; the message says which and how to fix it."""


@functools.cache
def compile_seccomp_filter(denied: tuple[str, ...] = DENIED_SYSCALLS) -> bytes:
    """The BPF program (``struct sock_filter`` array) denying ``denied`` with ``EPERM`` and allowing the rest."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(
            f"libseccomp.so.2 could not be loaded ({exc}); the tool sandbox's syscall filter needs it. Fix: "
            "apt-get install libseccomp2 (Debian/Ubuntu) or dnf install libseccomp (Fedora)") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.restype = ctypes.c_int
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    context = lib.seccomp_init(_ALLOW)
    if not context:
        raise SeccompUnavailable("libseccomp's seccomp_init failed: the syscall filter cannot be built")
    try:
        added = 0
        for name in denied:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # __NR_SCMP_ERROR: not a syscall on this architecture
                continue
            status = lib.seccomp_rule_add(context, _ERRNO_EPERM, number, 0)
            if status != 0:
                raise SeccompUnavailable(f"libseccomp refused a rule for {name} (error {-status})")
            added += 1
        if added == 0:
            raise SeccompUnavailable("libseccomp knows none of the denied syscalls on this architecture")
        with tempfile.TemporaryFile() as handle:
            status = lib.seccomp_export_bpf(context, handle.fileno())
            if status != 0:
                raise SeccompUnavailable(f"libseccomp could not export the filter (error {-status})")
            handle.seek(0)
            program = handle.read()
    finally:
        lib.seccomp_release(context)
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp wrote a {len(program)}-byte filter, not whole 8-byte instructions")
    return program


def filter_pipe(program: bytes) -> int:
    """A pipe's read end holding ``program`` (for ``bwrap --seccomp FD``); the caller closes it."""
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: far below the pipe buffer, never blocks
    finally:
        os.close(write)
    return read
