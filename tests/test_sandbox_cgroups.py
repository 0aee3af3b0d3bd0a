"""A sandbox's cgroup holds everything it starts: memory (tmpfs and memfd pages too), tasks, CPU time.

The behaviour tests run real processes (and one bubblewrap sandbox) in real cgroups, as root, on
whichever layout `open_cgroups` picks on this host (v1 on CI, v2 on most production hosts); a host
where neither is usable fails them with the reason, it does not skip them. cgroup v2's file
formats and its choice of where to create cgroups are also tested from sample file contents, so
they are checked on a v1-only host too.

Limits are small so that every case ends quickly, and nothing asserts a duration: a "hang guard"
bounds only how long a broken case may take to fail.
"""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.sandbox import SandboxSettings
from pipeline.sandbox.bubblewrap import bwrap_argv
from pipeline.sandbox.cgroups import (
    CgroupHierarchy,
    CgroupLimits,
    CgroupsUnavailable,
    Mount,
    ProcCgroups,
    SandboxCgroup,
    cgroup_dir,
    cpu_quota_us,
    open_cgroups,
    open_v2,
    parent_owner_pid,
    parse_keyed,
    parse_mountinfo,
    parse_proc_cgroup,
    usage_v1,
    usage_v2,
)
from pipeline.sandbox.uids import lease_uids

MiB = 1 << 20
HANG_GUARD_S = 120
LIMITS = CgroupLimits(memory_bytes=64 * MiB, pids=16, cpus=1.0)


@pytest.fixture
async def hierarchy():
    opened = open_cgroups("tests")
    if isinstance(opened, CgroupsUnavailable):
        pytest.fail(f"no usable cgroups on this host: {opened}")
    try:
        yield opened
    finally:
        await opened.close()
    assert not any(parent.exists() for parent in opened.parents)


@pytest.fixture
async def sandbox(hierarchy: CgroupHierarchy):
    cg = hierarchy.create(f"t-{uuid.uuid4().hex[:8]}", LIMITS)
    try:
        yield cg
    finally:
        await cg.remove()


def start_in(cg: SandboxCgroup, program: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-I", "-c", program],
        preexec_fn=cg.join_from_preexec,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def finished(proc: subprocess.Popen) -> tuple[str, str]:
    return await asyncio.to_thread(proc.communicate, timeout=HANG_GUARD_S)


async def until(condition, what: str) -> None:
    """Poll until `condition()` holds; the hang guard only turns a broken case into a failure."""
    async with asyncio.timeout(HANG_GUARD_S):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


def dead(pid: int) -> bool:
    """Gone, or a zombie (a killed orphan that init has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# ------------------------------------------------------------------ memory: the sandbox as a whole

# Writes 256 MiB, 1 MiB at a time, saying how far it got after each; a write error ends it with the
# errno's name. Every write is flushed, so the pages are charged as it goes.
FILL = """
import errno, os, sys
{open}
block = b"x" * (1 << 20)
for mib in range(1, 257):
    try:
        os.write(fd, block)
    except OSError as exc:
        print("error", errno.errorcode[exc.errno], flush=True)
        sys.exit(3)
    print(mib, flush=True)
"""
TMPFS_FILL = FILL.format(open="fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)")
MEMFD_FILL = FILL.format(open="fd = os.memfd_create('fill')")


def stopped_by_memory(proc: subprocess.Popen, out: str, cg: SandboxCgroup) -> str:
    """How the kernel stopped a program that wrote 256 MiB into a 64 MiB sandbox: 'oom_kill' or the
    write's errno. Fails if it was not stopped, or if the cgroup's counters do not say memory."""
    lines = out.split()
    usage = cg.usage()
    assert "256" not in lines, f"it wrote all 256 MiB in a {LIMITS.memory_bytes >> 20} MiB sandbox"
    if proc.returncode == -signal.SIGKILL:
        assert usage.oom_kills >= 1, usage
        return "oom_kill"
    assert proc.returncode == 3 and "error" in lines, (proc.returncode, out)
    reason = lines[lines.index("error") + 1]
    assert reason in ("ENOMEM", "ENOSPC"), reason
    assert usage.oom_kills or usage.memory_limit_hits or (usage.memory_peak_bytes or 0) >= LIMITS.memory_bytes
    return reason


@pytest.fixture
def tmpfs(tmp_path: Path):
    where = tmp_path / "tmpfs"
    where.mkdir()
    # Larger than the cgroup's limit: only the cgroup can stop the writer, not a full filesystem.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


async def test_tmpfs_pages_count_against_the_sandbox_memory(sandbox: SandboxCgroup, tmpfs: Path):
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", TMPFS_FILL, str(tmpfs / "fill")],
        preexec_fn=sandbox.join_from_preexec,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, _ = await finished(proc)
    how = stopped_by_memory(proc, out, sandbox)
    print(f"tmpfs write past the limit: {how}")  # kernel fact for the lead's classification
    assert (tmpfs / "fill").stat().st_size < 256 * MiB


async def test_memfd_pages_count_against_the_sandbox_memory(sandbox: SandboxCgroup):
    proc = start_in(sandbox, MEMFD_FILL)
    out, _ = await finished(proc)
    print(f"memfd write past the limit: {stopped_by_memory(proc, out, sandbox)}")


async def test_an_anonymous_allocation_past_the_limit_is_oom_killed(sandbox: SandboxCgroup):
    # Multiplying writes every byte, so every page is faulted in (bytearray(n) alone may not touch them).
    proc = start_in(sandbox, "block = bytearray(b'x') * (256 << 20)\nprint('allocated')")
    out, err = await finished(proc)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, out, err)
    usage = sandbox.usage()
    assert usage.oom_kills >= 1, usage
    assert usage.memory_peak_bytes is None or usage.memory_peak_bytes <= LIMITS.memory_bytes


async def test_memory_is_shared_by_every_process_of_the_sandbox(sandbox: SandboxCgroup):
    """Four processes of 24 MiB each: no one of them is near the limit, together they pass it."""
    program = """
import os, time
for _ in range(3):
    if os.fork() == 0:
        break
block = bytearray(b'x') * (24 << 20)
time.sleep(60)
"""
    proc = start_in(sandbox, program)
    await until(lambda: sandbox.usage().oom_kills >= 1, "an OOM kill")
    await sandbox.kill_all()
    await finished(proc)
    assert sandbox.procs() == []


async def test_a_bubblewrap_sandbox_is_held_by_its_cgroup(sandbox: SandboxCgroup):
    """The real thing: setpriv and bwrap joined from preexec_fn (as root, before the uid drops), a
    program filling bwrap's own tmpfs /work: stopped at the cgroup's limit, far below the tmpfs size."""
    settings = SandboxSettings(tmpfs_mb=512)
    lease = lease_uids(1, uid_base=settings.uid_base, uid_span=settings.uid_span, lock_dir=settings.uid_lock_dir)
    try:
        proc = subprocess.Popen(
            bwrap_argv(settings, lease.first),
            preexec_fn=sandbox.join_from_preexec,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin"},
        )
        program = TMPFS_FILL.replace("sys.argv[1]", "'/work/fill'")
        out, err = await asyncio.to_thread(proc.communicate, program.encode(), HANG_GUARD_S)
        await sandbox.kill_all()
    finally:
        lease.release()
    lines = out.decode().split()
    assert "256" not in lines, (out, err)
    usage = sandbox.usage()
    assert usage.oom_kills >= 1 or "error" in lines, (proc.returncode, out, err, usage)
    print(f"bwrap /work fill: exit {proc.returncode}, stopped after {lines[-1] if lines else 0} MiB, {usage}")


# ------------------------------------------------------------------ tasks, CPU, killing


async def test_a_fork_bomb_stays_under_the_task_limit_and_dies(hierarchy: CgroupHierarchy):
    cg = hierarchy.create("fork-bomb", CgroupLimits(memory_bytes=256 * MiB, pids=16, cpus=0.5))
    try:
        proc = start_in(cg, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
        await until(lambda: cg.usage().pids_limited, "a fork refused at pids.max")
        assert 0 < len(cg.procs()) <= 16
        await cg.kill_all()
        assert cg.procs() == []
        await finished(proc)
        usage = cg.usage()
        assert usage.pids_limited
        assert usage.pids_peak is None or usage.pids_peak <= 16
    finally:
        await cg.remove()


async def test_kill_all_without_a_freezer_still_empties_a_fork_bomb(hierarchy: CgroupHierarchy):
    """Hosts without a v1 freezer hierarchy kill by signals alone, racing the forks: the loop must still
    converge (a task with SIGKILL pending cannot fork). On v2 the same view still has cgroup.kill."""
    cg = hierarchy.create("bomb-no-freezer", CgroupLimits(memory_bytes=256 * MiB, pids=16, cpus=0.5))
    signals_only = SandboxCgroup(cg.version, cg.name, tuple(d for d in cg._dirs if "freezer" not in d.controllers))
    try:
        proc = start_in(cg, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
        await until(lambda: cg.usage().pids_limited, "a fork refused at pids.max")
        await signals_only.kill_all()
        assert cg.procs() == []
        await finished(proc)
    finally:
        await cg.remove()


# Leaves the process we started at once: a double fork and a new session, then one process in a group
# of its own; both keep forking children that start sessions of their own.
ESCAPER = """
import os, time

def breed():
    while True:
        try:
            if os.fork() == 0:
                os.setsid()
                time.sleep(600)
                os._exit(0)
        except OSError:
            pass
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)

if os.fork() == 0:
    os.setsid()
    quiet = os.open(os.devnull, os.O_RDWR)  # a daemon's manners: the test reads our stdout to EOF
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    if os.fork() == 0:
        if os.fork() == 0:
            os.setpgid(0, 0)
        breed()
    os._exit(0)
os.wait()
print("escaped", flush=True)
"""


async def test_kill_all_kills_what_left_its_session_and_group_while_it_forks(hierarchy: CgroupHierarchy):
    cg = hierarchy.create("escaper", CgroupLimits(memory_bytes=256 * MiB, pids=32, cpus=1.0))
    try:
        proc = start_in(cg, ESCAPER)
        out, _ = await finished(proc)
        assert out.strip() == "escaped"
        # Several sessions and groups, none of them the started process's, still forking.
        await until(lambda: len(cg.procs()) >= 6, "the escapers and their children")
        escaped = cg.procs()
        sessions = set()
        for pid in escaped:
            with contextlib.suppress(ProcessLookupError):
                sessions.add(os.getsid(pid))
        assert len(sessions) >= 3 and proc.pid not in sessions
        await cg.kill_all()
        assert cg.procs() == []
        assert all(dead(pid) for pid in escaped)
    finally:
        await cg.remove()


async def test_a_cpu_limit_throttles_two_spinning_processes(hierarchy: CgroupHierarchy):
    if "cpu" not in hierarchy.controllers:
        pytest.fail(f"no cpu controller in {hierarchy}: the CPU limit is not in force on this host")
    cg = hierarchy.create("spin", CgroupLimits(memory_bytes=128 * MiB, pids=8, cpus=0.5))
    try:
        assert cg.limits().cpus == 0.5
        proc = start_in(cg, "import os\nos.fork()\nwhile True:\n    pass\n")
        await until(lambda: (cg.usage().cpu_throttled_periods or 0) > 0, "a throttled CFS period")
        await cg.kill_all()
        await finished(proc)
        usage = cg.usage()
        assert usage.cpu_seconds is None or usage.cpu_seconds > 0
    finally:
        await cg.remove()


async def test_a_process_started_with_join_from_preexec_is_in_the_sandbox(sandbox: SandboxCgroup):
    proc = subprocess.Popen(["sleep", "600"], preexec_fn=sandbox.join_from_preexec)
    try:
        assert sandbox.procs() == [proc.pid]
        membership = Path(f"/proc/{proc.pid}/cgroup").read_text()
        assert f"/{sandbox.name}\n" in membership
    finally:
        await sandbox.kill_all()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and sandbox.procs() == []


async def test_a_sandbox_that_cannot_join_its_cgroup_never_runs(hierarchy: CgroupHierarchy, tmp_path: Path):
    cg = hierarchy.create("gone", LIMITS)
    await cg.remove()
    marker = tmp_path / "ran"
    with pytest.raises(subprocess.SubprocessError):
        subprocess.Popen(["touch", str(marker)], preexec_fn=cg.join_from_preexec)
    assert not marker.exists()


# ------------------------------------------------------------------ limits, names, cleanup


async def test_limits_can_be_raised_and_lowered(sandbox: SandboxCgroup):
    """On v1 memory.memsw.limit_in_bytes must stay >= memory.limit_in_bytes at every step (EINVAL
    otherwise): raising sets memsw first, lowering sets it last."""
    assert sandbox.limits() == LIMITS
    for memory in (128 * MiB, 32 * MiB, 96 * MiB):
        changed = CgroupLimits(memory_bytes=memory, pids=8, cpus=0.25)
        sandbox.set_limits(changed)
        assert sandbox.limits() == changed


async def test_create_refuses_a_name_in_use_and_leaves_nothing_behind(hierarchy: CgroupHierarchy):
    first = hierarchy.create("same", LIMITS)
    try:
        with pytest.raises(FileExistsError):
            hierarchy.create("same", LIMITS)
        assert first.procs_files and all(Path(f).exists() for f in first.procs_files)
        with pytest.raises(ValueError):
            hierarchy.create("../escape", LIMITS)
    finally:
        await first.remove()
    assert not any(Path(f).exists() for f in first.procs_files)


async def test_close_kills_and_removes_sandboxes_left_open():
    opened = open_cgroups("tests")
    assert not isinstance(opened, CgroupsUnavailable), opened
    cg = opened.create("left-open", LIMITS)
    proc = subprocess.Popen(["sleep", "600"], preexec_fn=cg.join_from_preexec)
    await opened.close()
    assert proc.wait(HANG_GUARD_S) == -signal.SIGKILL
    assert not any(parent.exists() for parent in opened.parents)


async def test_sweep_stale_removes_the_parents_of_dead_pools_only(hierarchy: CgroupHierarchy):
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names a pool whose process is dead
    sleeper = subprocess.Popen(["sleep", "600"])  # its pid names a live pool
    stale = open_cgroups("dead pool", owner_pid=gone.pid)
    live = open_cgroups("live pool", owner_pid=sleeper.pid)
    assert isinstance(stale, CgroupHierarchy) and isinstance(live, CgroupHierarchy)
    try:
        left = stale.create("left-running", LIMITS)
        orphan = subprocess.Popen(["sleep", "600"], preexec_fn=left.join_from_preexec)
        live.create("busy", LIMITS)
        assert await hierarchy.sweep_stale() >= 1
        assert not any(parent.exists() for parent in stale.parents)
        assert orphan.wait(HANG_GUARD_S) == -signal.SIGKILL
        assert all(parent.exists() for parent in (*live.parents, *hierarchy.parents))
    finally:
        await stale.close()
        await live.close()
        sleeper.kill()
        sleeper.wait()


# ------------------------------------------------------------------ cgroup v2 from sample files

# A systemd host with pure cgroup v2, a v1 co-mount, and a cgroup2 mount of a subtree at a path with a space.
MOUNTINFO = r"""22 27 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 22 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
35 26 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 /sub /mnt/with\040space rw,relatime - cgroup2 cgroup2 rw
"""


def test_mountinfo_names_each_mount_its_type_root_and_controllers():
    sysfs, v2, v1, bound = parse_mountinfo(MOUNTINFO)
    assert (sysfs.fstype, sysfs.mount_point) == ("sysfs", "/sys")
    assert (v2.fstype, v2.mount_point, v2.root) == ("cgroup2", "/sys/fs/cgroup", "/")
    assert v1.fstype == "cgroup" and {"cpu", "cpuacct"} <= v1.super_options
    assert (bound.mount_point, bound.root) == ("/mnt/with space", "/sub")


def test_proc_cgroup_gives_the_unified_path_and_each_v1_controllers_path():
    pure = parse_proc_cgroup("0::/system.slice/reward.service\n")
    assert pure == ProcCgroups(unified="/system.slice/reward.service", v1={})
    hybrid = parse_proc_cgroup("4:memory:/process_api/abc\n2:cpu,cpuacct:/\n1:name=systemd:/\n0::/\n")
    assert hybrid.unified == "/"
    assert hybrid.v1["memory"] == "/process_api/abc" and hybrid.v1["cpu"] == hybrid.v1["cpuacct"] == "/"
    assert parse_proc_cgroup("4:memory:/x\n").unified is None


def test_a_cgroup_path_is_found_under_a_mount_of_its_subtree_only():
    _, v2, _, bound = parse_mountinfo(MOUNTINFO)
    assert cgroup_dir(v2, "/") == Path("/sys/fs/cgroup")
    assert cgroup_dir(v2, "/system.slice/a.service") == Path("/sys/fs/cgroup/system.slice/a.service")
    assert cgroup_dir(bound, "/sub/x") == Path("/mnt/with space/x")
    assert cgroup_dir(bound, "/sub") == Path("/mnt/with space")
    assert cgroup_dir(bound, "/subway") is None and cgroup_dir(bound, "/") is None


def test_v2_usage_from_memory_events_pids_events_and_cpu_stat():
    usage = usage_v2(
        memory_events="low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n",
        memory_peak="67108864\n",
        pids_events="max 3\n",
        pids_peak="16\n",
        cpu_stat="usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 40\nnr_throttled 7\n"
        "throttled_usec 90000\nnr_bursts 0\nburst_usec 0\n",
    )
    assert usage.oom_kills == 1 and usage.memory_limit_hits == 12 and usage.memory_peak_bytes == 64 * MiB
    assert usage.pids_limited and usage.pids_peak == 16
    assert usage.cpu_seconds == 2.5 and usage.cpu_throttled_periods == 7
    # An older kernel: no memory.peak or pids.peak; no cpu controller, so cpu.stat has no nr_throttled.
    bare = usage_v2("oom_kill 0\n", None, "max 0\n", None, "usage_usec 0\nuser_usec 0\nsystem_usec 0\n")
    assert bare.memory_peak_bytes is None and bare.pids_peak is None and not bare.pids_limited
    assert bare.cpu_seconds == 0.0 and bare.cpu_throttled_periods is None


def test_v1_usage_from_oom_control_failcnt_pids_events_and_cpuacct():
    usage = usage_v1(
        oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
        failcnts=("0\n", "119\n"),
        max_usage="67108864\n",
        pids_events="max 0\n",
        pids_peak=None,
        cpuacct_usage_ns="1500000000\n",
        cpu_stat="nr_periods 10\nnr_throttled 2\nthrottled_time 5\n",
    )
    assert usage.oom_kills == 4 and usage.memory_limit_hits == 119 and usage.memory_peak_bytes == 64 * MiB
    assert not usage.pids_limited and usage.pids_peak is None
    assert usage.cpu_seconds == 1.5 and usage.cpu_throttled_periods == 2


def test_keyed_files_and_names():
    assert parse_keyed("max 3\nnot a pair here\nfrozen 1\n") == {"max": 3, "frozen": 1}
    assert parent_owner_pid("sprawl-sandbox-4242-0a1b2c3d") == 4242
    assert parent_owner_pid("sprawl-sandbox-4242-zz") is None and parent_owner_pid("other") is None
    assert cpu_quota_us(0.5) == 50_000 and cpu_quota_us(2) == 200_000 and cpu_quota_us(0.001) == 1000
    with pytest.raises(ValueError):
        CgroupLimits(memory_bytes=64 * MiB, pids=0, cpus=1)
    with pytest.raises(ValueError):
        CgroupLimits(memory_bytes=64 * MiB, pids=1, cpus=0)


def fake_v2_tree(tmp_path: Path, controllers: str) -> tuple[list[Mount], ProcCgroups]:
    """A cgroup2 mount at tmp_path holding this process in /workers/reward (plain files: only what is
    decided before anything is created can be checked this way)."""
    own = tmp_path / "workers" / "reward"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text(controllers + "\n")
    mount = Mount(mount_point=str(tmp_path), root="/", fstype="cgroup2", super_options=frozenset({"rw"}))
    return [mount], ProcCgroups(unified="/workers/reward", v1={})


def test_v2_is_unusable_without_memory_and_pids_delegated_and_says_so(tmp_path: Path):
    mounts, proc = fake_v2_tree(tmp_path, "hugetlb")
    why = open_v2(mounts, proc, "sprawl-sandbox-1-00000000")
    assert isinstance(why, str) and "memory, pids not available" in why and "hugetlb" in why
    assert open_v2(mounts, ProcCgroups(unified=None, v1={}), "p") == (
        "this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)"
    )
    elsewhere = ProcCgroups(unified="/x", v1={})
    outside = [Mount(mount_point=str(tmp_path), root="/sub", fstype="cgroup2", super_options=frozenset())]
    assert "no cgroup2 mount shows" in open_v2(outside, elsewhere, "p")
    assert list((tmp_path / "workers" / "reward").iterdir()) == [tmp_path / "workers" / "reward" / "cgroup.controllers"]


async def test_this_hosts_cgroup_v2_is_used_or_passed_over_with_a_reason():
    """Whatever this host has: a v2 mount that cannot hold sandboxes (the hybrid CI machines') is passed
    over, with a reason naming what is missing; one that can is what `open_cgroups` uses."""
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    proc = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    name = f"sprawl-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    result = open_v2(mounts, proc, name)
    opened = open_cgroups("tests")
    try:
        if isinstance(result, str):
            assert "v2" in result or "cgroup2" in result
            assert isinstance(opened, CgroupsUnavailable) or opened.version == 1
        else:
            os.rmdir(result.path / name)
            assert {"memory", "pids"} <= result.controllers
            assert isinstance(opened, CgroupHierarchy) and opened.version == 2
    finally:
        if isinstance(opened, CgroupHierarchy):
            await opened.close()


def test_v2_says_where_it_tried_and_leaves_no_parent_behind(tmp_path: Path):
    """Controllers listed for our cgroup, but our cgroup cannot enable them for children (here: no
    subtree_control file; on a host, EBUSY) and a new cgroup beside it gets none (plain files pass
    nothing on): both places tried are named, and nothing is left behind."""
    mounts, proc = fake_v2_tree(tmp_path, "cpu memory pids")
    why = open_v2(mounts, proc, "sprawl-sandbox-1-00000000")
    assert isinstance(why, str) and why.startswith("cgroup v2: ")
    assert f"cannot enable memory, pids in {tmp_path}/workers/reward/cgroup.subtree_control" in why
    assert f"memory, pids not available in {tmp_path}/workers/sprawl-sandbox-1-00000000" in why
    assert not list(tmp_path.rglob("sprawl-sandbox-*"))
