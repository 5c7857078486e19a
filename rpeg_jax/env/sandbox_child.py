"""The python tool's launcher: runs as the first program of the sandbox's child process, confines that
process with unprivileged kernel mechanisms, then replaces itself (execve) with the interpreter on the
model's code. Confinement is inherited across execve and fork, so the code and anything it starts run
confined.

It is standalone (the standard library and ctypes, no rpeg_jax import): env/sandbox.py runs it as
`python -I -S -c <this file's text> <settings JSON>`, so it needs nothing from the parent's
sys.path and runs in a fresh interpreter (no threads, no locks inherited from the trainer, which
preexec_fn would risk). What it does, in order (x86_64 Linux; docs/agentic.md says what each
protects against and what it does not):

  1. rlimits: RLIMIT_CPU (seconds, SIGXCPU then SIGKILL one second later), RLIMIT_AS (bytes of address
     space), RLIMIT_FSIZE (largest file written, stdout/stderr included), RLIMIT_NOFILE, RLIMIT_CORE=0.
  2. identity: as root, drop to uid/gid 65534 (nobody, no supplementary groups) when the interpreter
     is reachable by that uid; otherwise stay uid 0 with every capability dropped (bounding set,
     securebits NOROOT locked, capset to empty), so execve does not give them back.
  3. processes: as a non-root uid, a fresh user namespace (unshare(CLONE_NEWUSER)) gives the sandbox
     its own RLIMIT_NPROC count (kernel >= 5.14 counts rlimits per user namespace), then
     RLIMIT_NPROC = max_processes ("rlimit" mode). Otherwise (uid 0, whom RLIMIT_NPROC never binds,
     or no user namespaces) the seccomp filter refuses new processes (fork, vfork, clone without
     CLONE_THREAD: EPERM) and allows threads only ("no_fork" mode).
  4. prctl(PR_SET_NO_NEW_PRIVS), then Landlock (syscalls 444-446) at the highest ABI the kernel has:
     read/execute only beneath the interpreter's directories and the system's (/usr, /lib, /lib64,
     /bin, /etc), read/write/create/remove only beneath the working directory, /dev/null read-write,
     /dev/{zero,random,urandom} read; ABI >= 4: no TCP bind or connect; ABI >= 6: no signals to, and
     no abstract unix sockets of, processes outside the sandbox. Mounts are refused by Landlock.
  5. seccomp-BPF (SECCOMP_SET_MODE_FILTER): a non-x86_64 syscall ABI kills the process; x32 syscalls,
     sockets (socket, connect, bind, listen, accept, accept4), io_uring, namespaces (unshare, setns,
     clone with CLONE_NEW*), mounts, ptrace and process_vm_*, kcmp, pidfd_getfd, bpf, perf_event_open,
     userfaultfd, keyrings, kernel modules, kexec, reboot, swap, clock and hostname changes, iopl,
     setsid/setpgid (the code stays in the process group the parent kills), setpriority and real-time
     scheduling, prlimit64 on another process, and (without Landlock's signal scoping) every signal
     syscall fail with EPERM; clone3 fails with ENOSYS (glibc then uses clone, whose flags the
     filter can see).
  6. report what was applied as one JSON line on the report fd (the parent reads it), close it, execve.

A step that must succeed (rlimits, no_new_privs, seccomp) failing ends the launcher with status 125
and the reason in the report, before any of the code runs.
"""

import ctypes
import json
import os
import resource
import struct
import sys

NOBODY = 65534
CLONE_NEWUSER = 0x10000000
CLONE_THREAD = 0x00010000
CLONE_NEW_MASK = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET (NEWTIME is clone3-only)

PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 24, 28, 38, 47
SECURE_BITS = 0xE3  # NOROOT, NOROOT_LOCKED, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE(_LOCKED)

SYS_CAPSET, SYS_SECCOMP = 126, 317
SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 444, 445, 446

# Landlock access rights by the ABI that introduced them (include/uapi/linux/landlock.h).
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # valid on a file rule

# seccomp-BPF
AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # struct seccomp_data: nr, arch, instruction_pointer, args[6]

DENIED = {  # x86_64 syscall numbers (asm/unistd_64.h) that fail with EPERM
    "socket": 41, "connect": 42, "accept": 43, "bind": 49, "listen": 50, "accept4": 288,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "unshare": 272, "setns": 308,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "fanotify_init": 300,
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "quotactl_fd": 443,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "syslog": 103, "vhangup": 153,
    "open_by_handle_at": 304, "name_to_handle_at": 303, "uselib": 134, "lookup_dcookie": 212,
    "setsid": 112, "setpgid": 109, "setpriority": 141, "sched_setscheduler": 144, "sched_setparam": 142,
    "sched_setattr": 314, "ioprio_set": 251, "migrate_pages": 256, "move_pages": 279,
}  # fmt: skip
SIGNALS = {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
           "pidfd_send_signal": 424, "pidfd_open": 434}  # fmt: skip
FORKS = {"fork": 57, "vfork": 58}
SYS_CLONE, SYS_CLONE3, SYS_PRLIMIT64, SYS_SCHED_SETAFFINITY = 56, 435, 302, 203

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl.restype = ctypes.c_int


class SandboxSetupError(RuntimeError):
    pass


def _check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise SandboxSetupError(f"{what}: {os.strerror(err)} (errno {err})")
    return ret


def _prctl(option, arg2=0, arg3=0, arg4=0, arg5=0, what="prctl"):
    args = [ctypes.c_ulong(a) for a in (arg2, arg3, arg4, arg5)]
    return _check(libc.prctl(ctypes.c_int(option), *args), what)


# ---- 1. rlimits -------------------------------------------------------------------------------------


def set_limits(lim: dict) -> None:
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = int(lim["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    fsize = int(lim["file_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(lim["open_files"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# ---- 2. identity ------------------------------------------------------------------------------------


def reachable_as(uid: int, paths: list[str]) -> bool:
    """Whether uid/gid `uid` (no supplementary groups) can execute paths[0] and read the others."""
    os.setgroups([])
    os.setegid(uid)
    os.seteuid(uid)
    try:
        ok = os.access(paths[0], os.X_OK, effective_ids=True)
        return ok and all(os.access(p, os.R_OK | os.X_OK, effective_ids=True) for p in paths[1:])
    finally:
        os.seteuid(0)
        os.setegid(0)


def drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
        raise SandboxSetupError(f"could not become uid {uid}")


def drop_capabilities() -> None:
    """uid 0 stays, with no capability: bounding set emptied, NOROOT locked (execve does not grant root
    its capabilities), ambient cleared, permitted/effective/inheritable set to empty."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap, what=f"PR_CAPBSET_DROP {cap}")
    _prctl(PR_SET_SECUREBITS, SECURE_BITS, what="PR_SET_SECUREBITS")
    _prctl(PR_CAP_AMBIENT, 4, what="PR_CAP_AMBIENT_CLEAR_ALL")
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two {effective, permitted, inheritable} words, all zero
    _check(libc.syscall(ctypes.c_long(SYS_CAPSET), header, data), "capset")
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, v in (line.split(":", 1) for line in f if line.startswith("Cap"))}
    if any(int(caps[k], 16) for k in ("CapEff", "CapPrm", "CapBnd")):
        raise SandboxSetupError(f"capabilities remain: {caps}")


# ---- 3. processes -----------------------------------------------------------------------------------


def own_user_namespace() -> bool:
    return libc.unshare(ctypes.c_int(CLONE_NEWUSER)) == 0


# ---- 4. Landlock ------------------------------------------------------------------------------------


def landlock_abi() -> int:
    abi = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


def landlock_rights(abi: int) -> tuple[int, int, int]:
    """(handled fs rights, handled net rights, scopes) that ABI `abi` knows."""
    fs = (1 << 13) - 1
    if abi >= 2:
        fs |= FS_REFER
    if abi >= 3:
        fs |= FS_TRUNCATE
    if abi >= 5:
        fs |= FS_IOCTL_DEV
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
    return fs, net, scoped


def landlock_ruleset(abi: int, read_paths: list[str], work: str) -> tuple[int, list[str]]:
    """A ruleset fd with the sandbox's rules (not yet enforced), and the read paths that exist."""
    fs, net, scoped = landlock_rights(abi)
    attr = struct.pack("QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    fd = _check(
        libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE), attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )
    read = FS_READ_FILE | FS_READ_DIR | FS_EXECUTE
    write = FS_READ_FILE | FS_READ_DIR | FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG
    write |= FS_MAKE_SYM | FS_MAKE_FIFO | FS_REFER | FS_TRUNCATE  # never MAKE_CHAR / MAKE_BLOCK
    rules = [(p, read) for p in read_paths] + [(work, write)]
    rules += [("/dev/null", FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV)]
    rules += [(p, FS_READ_FILE | FS_IOCTL_DEV) for p in ("/dev/zero", "/dev/random", "/dev/urandom")]
    used = []
    for path, rights in rules:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this system lacks
        try:
            rights &= fs
            if not os.path.isdir(path):
                rights &= FILE_RIGHTS
            rule = struct.pack("=Qi", rights, pfd)  # struct landlock_path_beneath_attr (packed)
            _check(libc.syscall(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(fd), ctypes.c_int(1), rule,
                                ctypes.c_uint32(0)), f"landlock_add_rule {path}")  # fmt: skip
            used.append(path)
        finally:
            os.close(pfd)
    return fd, used


def landlock_enforce(fd: int) -> None:
    _check(libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT), ctypes.c_int(fd), ctypes.c_uint32(0)),
           "landlock_restrict_self")  # fmt: skip
    os.close(fd)


# ---- 5. seccomp -------------------------------------------------------------------------------------


def _stmt(code, k):
    return (code, 0, 0, k)


def _jump(code, k, jt, jf):
    return (code, jt, jf, k)


def seccomp_program(no_fork: bool, deny_signals: bool) -> list[tuple[int, int, int, int]]:
    """The BPF program (module doc, step 5) as (code, jt, jf, k) instructions."""
    eperm = RET_ERRNO | EPERM
    prog = [
        _stmt(LD_W_ABS, OFF_ARCH),
        _jump(JEQ, AUDIT_ARCH_X86_64, 1, 0),
        _stmt(RET, RET_KILL_PROCESS),
        _stmt(LD_W_ABS, OFF_NR),
        _jump(JGE, X32_BIT, 0, 1),
        _stmt(RET, eperm),
        _jump(JEQ, SYS_CLONE3, 0, 1),
        _stmt(RET, RET_ERRNO | ENOSYS),
    ]
    denied = dict(DENIED)
    if deny_signals:
        denied.update(SIGNALS)
    if no_fork:
        denied.update(FORKS)
    for nr in sorted(set(denied.values())):
        prog += [_jump(JEQ, nr, 0, 1), _stmt(RET, eperm)]
    # pid-taking calls: only this process (pid 0) may be changed
    for nr in (SYS_PRLIMIT64, SYS_SCHED_SETAFFINITY):
        prog += [
            _jump(JEQ, nr, 0, 4),
            _stmt(LD_W_ABS, OFF_ARG0),
            _jump(JEQ, 0, 1, 0),
            _stmt(RET, eperm),
            _stmt(RET, RET_ALLOW),
        ]
    clone = [_stmt(LD_W_ABS, OFF_ARG0), _jump(JSET, CLONE_NEW_MASK, 0, 1), _stmt(RET, eperm)]
    if no_fork:  # threads only
        clone += [_jump(JSET, CLONE_THREAD, 1, 0), _stmt(RET, eperm)]
    clone += [_stmt(RET, RET_ALLOW)]
    prog += [_jump(JEQ, SYS_CLONE, 0, len(clone))] + clone
    prog += [_stmt(RET, RET_ALLOW)]
    return prog


def install_seccomp(prog) -> None:
    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    _check(libc.syscall(ctypes.c_long(SYS_SECCOMP), ctypes.c_uint(1), ctypes.c_uint(0), ctypes.byref(fprog)),
           "seccomp(SECCOMP_SET_MODE_FILTER)")  # fmt: skip


# ---- the launcher -----------------------------------------------------------------------------------


def confine(cfg: dict, report: dict) -> None:
    if os.uname().machine != "x86_64":
        raise SandboxSetupError(f"the sandbox's seccomp filter is for x86_64, not {os.uname().machine}")
    set_limits(cfg["limits"])
    report["rlimits"] = True
    if os.geteuid() == 0:
        if reachable_as(NOBODY, [cfg["exe"], *cfg["need_paths"]]):
            for name in (cfg["work"], os.path.join(cfg["work"], "main.py")):  # its directory becomes its own
                os.chown(name, NOBODY, NOBODY)
            drop_to(NOBODY)
            report["identity"] = f"uid {NOBODY}"
        else:
            drop_capabilities()
            report["identity"] = "uid 0 without capabilities (the interpreter is not reachable by uid 65534)"
    else:
        report["identity"] = f"uid {os.getuid()} (the parent's)"
    report["uid"] = os.getuid()
    max_procs = int(cfg["limits"]["max_processes"])
    no_fork = True
    if os.getuid() != 0 and own_user_namespace():
        resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))
        no_fork = False
    report["processes"] = "no_fork" if no_fork else f"rlimit {max_procs}"
    _prctl(PR_SET_PDEATHSIG, 9, what="PR_SET_PDEATHSIG")  # after any credential change, which clears it
    if os.getppid() != cfg["parent_pid"]:
        raise SandboxSetupError("the parent exited")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, what="PR_SET_NO_NEW_PRIVS")
    abi = landlock_abi()
    report["landlock_abi"] = abi
    scoped = False
    if abi >= 1:
        fd, _ = landlock_ruleset(abi, cfg["read_paths"], cfg["work"])
        landlock_enforce(fd)
        scoped = abi >= 6
    report["landlock"] = (
        "off (the kernel has no Landlock)"
        if abi < 1
        else f"ABI {abi}: writes only in the working directory, reads in the interpreter's and system "
        "directories" + ("; no TCP bind/connect" if abi >= 4 else "") + ("; signals scoped" if scoped else "")
    )
    install_seccomp(seccomp_program(no_fork, deny_signals=not scoped))
    report["seccomp"] = True


def main() -> None:
    cfg = json.loads(sys.argv[1])
    fd = cfg["report_fd"]
    report: dict = {}
    try:
        confine(cfg, report)
    except Exception as e:  # any failure: the code must not run unconfined
        report["error"] = f"{type(e).__name__}: {e}"
        os.write(fd, json.dumps(report).encode() + b"\n")
        os._exit(125)
    os.write(fd, json.dumps(report).encode() + b"\n")
    os.close(fd)
    os.execve(cfg["exe"], cfg["argv"], cfg["env"])


if __name__ == "__main__":
    main()
