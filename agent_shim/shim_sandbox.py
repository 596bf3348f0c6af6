"""The episode's file-system and network sandbox, entered by the worker before it imports the
agent. Loaded with ``load_part("sandbox")``; standard library only, Python 3.9+.

The parent computed the plan (``isolate/_core/containment/sandbox.py``): Landlock rules as
``[path, kind]`` pairs, mounts as ``[op, path]`` pairs, the TCP ports. Here, in this order:

1. a mount namespace of our own, if the episode has none (``unshare_mounts``), private, so
   nothing mounted here reaches the machine, with a /dev of its own (``shim_world.py``; a PID
   namespace's PID 1 has built one already);
2. the mounts: ``view`` makes every mount below a path read-only and nosuid (``/``: the
   episode's view of the machine), ``rw`` binds a writable path onto itself, writable and
   nodev, ``pin`` binds a directory onto itself (a mount point cannot be renamed or removed),
   ``ro`` binds a path read-only onto itself, ``hide-dir`` puts an empty read-only tmpfs over a
   directory, ``hide-file`` binds ``/dev/null`` read-only over a file;
3. no_new_privs, and one Landlock domain: every file-system right this kernel knows is handled
   (so denied unless a rule allows it), and TCP connect when there are ports. A domain also
   refuses the agent mount and umount, so it cannot take the mounts away.

Every call into the C library goes through the shim's ``c_call`` (ints, bytes, None), the
Landlock part's too: importing ctypes would cost every episode ~1.7 ms. The mount flags are
the world part's.

``enter(plan)`` returns what could not be done, one line each; the caller decides whether
that ends the episode (``best_effort``).
"""

import os
import sys

shim = sys.modules["_isolate_shim"]
world = shim.load_part("world")


def enter(plan):
    """Enter the sandbox ``plan``; what could not be done."""
    problems = []

    def mount(source, target, fstype, flags, data=None):
        args = [None if x is None else os.fsencode(x) for x in (source, target, fstype)]
        result, errno = shim.c_call("mount", args[0], args[1], args[2], flags, data)
        return os.strerror(errno) if result != 0 else None

    if plan.get("unshare_mounts"):
        result, errno = shim.c_call("unshare", shim.CLONE_NEWNS)
        if result != 0:
            problem = "unshare(mount): " + os.strerror(errno)
        else:
            problem = mount(None, "/", None, world.MS_REC | world.MS_PRIVATE)
        if problem is not None:
            problems.append("mounts: no mount namespace of our own: %s" % problem)
            mount = None
        else:
            # The machine's /dev is shared (its terminals, its disks; /dev/shm outlives the
            # episode): one of the episode's own, as PID 1 of a namespace builds it.
            problem = world.private_dev(mount)
            if problem is not None:
                problems.append("mounts: no private /dev: %s" % problem)
    if mount is not None:
        for op, path in plan.get("mounts", ()):
            problem = _mount_one(mount, op, path)
            if problem is not None:
                problems.append("mount %s %s: %s" % (op, path, problem))
        try:
            # The working directory, entered before the mounts, is the mount below them still.
            os.chdir(os.getcwd())
        except OSError as exc:
            problems.append("mounts: cannot enter the working directory again: %s" % exc)
    problems.extend(_landlock(plan, shim.load_part("landlock")))
    return problems


def _mount_one(mount, op, path):
    if not os.path.lexists(path):
        return None  # gone since the parent looked: nothing left to protect or hide
    if op == "view":
        return _read_only_view(path)
    if op == "rw":
        # A writable path in the read-only view: a bind of its own, writable, no devices.
        problem = mount(path, path, None, world.MS_BIND | world.MS_REC)
        attrs = world.MOUNT_ATTR_NODEV, world.MOUNT_ATTR_RDONLY
        return problem or world.mount_setattr(path, 0, *attrs)
    if op == "pin":
        return mount(path, path, None, world.MS_BIND | world.MS_REC)
    if op == "ro":
        problem = mount(path, path, None, world.MS_BIND | world.MS_REC)
    elif op == "hide-dir":
        flags = world.MS_RDONLY | world.MS_NOSUID | world.MS_NODEV | world.MS_NOEXEC
        return mount("tmpfs", path, "tmpfs", flags, b"size=4k,nr_inodes=1,mode=500")
    elif op == "hide-file":
        problem = mount("/dev/null", path, None, world.MS_BIND)
    else:
        return "unknown mount operation"
    return problem or world.remount_read_only(mount, path)


def _read_only_view(top):
    """Every mount at and below ``top`` read-only and nosuid, so that what the agent may not
    write it cannot chmod, chown, touch or set an attribute on either (EROFS), whatever its
    capabilities; the episode's own /dev/shm, /dev/pts and /dev/mqueue stay writable. A problem
    or None."""
    read_only = world.MOUNT_ATTR_RDONLY | world.MOUNT_ATTR_NOSUID
    problem = world.mount_setattr(top, world.AT_RECURSIVE, read_only, 0)
    for path in ("/dev/shm", "/dev/pts", "/dev/mqueue"):
        if problem is None and os.path.ismount(path):
            problem = world.mount_setattr(path, 0, 0, world.MOUNT_ATTR_RDONLY)
    return problem


def _landlock(plan, ll):
    problems = []
    try:
        ll.no_new_privs()
    except OSError as exc:
        problems.append("no_new_privs: %s" % exc.strerror)
    abi = ll.abi()
    if abi < 1:
        return problems + ["file-system rules: this kernel has no Landlock"]
    handled = max(mask for version, mask in ll.FS_BY_ABI.items() if version <= abi)
    read_dir = ll.FS_EXECUTE | ll.FS_READ_FILE | ll.FS_READ_DIR
    file_rights = ll.FS_EXECUTE | ll.FS_READ_FILE | ll.FS_WRITE_FILE | ll.FS_TRUNCATE
    access = {
        "ld": ll.FS_READ_DIR,
        "rd": read_dir,
        "rf": ll.FS_EXECUTE | ll.FS_READ_FILE,
        "wd": handled,
        "wf": file_rights | ll.FS_IOCTL_DEV,
        "dev": ll.FS_READ_FILE | ll.FS_WRITE_FILE | ll.FS_TRUNCATE | ll.FS_IOCTL_DEV,
    }
    ports = plan.get("ports")
    net = ll.NET_CONNECT_TCP if ports is not None and abi >= 4 else 0
    if ports is not None and not net:
        problems.append("TCP connect ports: need Landlock ABI 4, this kernel has %d" % abi)
    try:
        ruleset = ll.create_ruleset(fs=handled, net=net)
    except OSError as exc:
        return problems + ["Landlock ruleset: %s" % exc.strerror]
    try:
        for path, kind in plan.get("rules", ()):
            try:
                # The parent sent real paths: never follow a link that appeared since.
                ll.add_path_rule(ruleset, path, access[kind] & handled, follow=False)
            except FileNotFoundError:
                pass  # gone since the parent looked
            except OSError as exc:
                problems.append("Landlock rule for %s: %s" % (path, exc.strerror))
        for port in ports if net else ():
            ll.add_port_rule(ruleset, port, ll.NET_CONNECT_TCP)
        ll.restrict_self(ruleset)
    except OSError as exc:
        problems.append("Landlock: %s" % exc.strerror)
    finally:
        os.close(ruleset)
    return problems
