"""A real Slurm on this machine for the tests (issue 24) and for `make slurm`: munge, slurmctld
and N slurmd nodes, each node in its own network, mount, UTS and PID namespaces (its own 10.x
address on a bridge the cluster makes, its own tmpfs at /dev/shm and at the store path, its own
read-only direct-I/O loop device of one ext4 image as the shared "NFS" source, so per-node
source bytes can be counted), and a non-root user who submits jobs.  Root only; stop() kills
everything it started by PID and leaves nothing mounted, no user, no bridge.

Run as a script (``make slurm``) it starts a cluster and waits: it prints how to use it.
SIGTERM or SIGHUP while a cluster lives stops it first (its daemons are in sessions of their
own: a closed terminal or a CI timeout would not reach them); one whose process was killed
outright is swept by the next cluster's start (tests/slurmstate.py).
Long because a cluster is one object: its set-up, use and tear-down share every name.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tests.slurmstate import Record, sweep

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")
PACKAGES = "slurmctld slurmd slurm-client munge"


def missing() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    if os.geteuid() != 0:
        return "the Slurm cluster needs root (namespaces, loop devices, a bridge, a user)"
    need = [b for b in SLURM_BINARIES if not shutil.which(b)]
    need += [b for b in ("ip", "unshare", "nsenter", "losetup", "mkfs.ext4", "useradd", "setpriv")
             if not shutil.which(b)]  # fmt: skip
    if need:
        return f"Slurm is not installed (apt-get install {PACKAGES}): missing {' '.join(need)}"
    return None


# Numbers this process's clusters: a test module keeps several alive at once, whose users
# and bridges need names of their own (two random digits met within one run).
_SERIAL = itertools.count()
CGROUP = "/sys/fs/cgroup"
CGROUP_CONTROLLERS = ("freezer", "memory", "cpuset", "devices")  # what Slurm's cgroup/v1 uses


def cgroup_missing() -> str | None:
    """Why Slurm's cgroup plugins (cgroup/v1) cannot run here, or None."""
    mounts = [m.split() for m in Path("/proc/self/mounts").read_text().splitlines()]
    have = {m[1] for m in mounts if m[2] == "cgroup"}
    need = [c for c in CGROUP_CONTROLLERS if f"{CGROUP}/{c}" not in have]
    return f"no cgroup v1 {' '.join(need)} under {CGROUP} (Slurm's cgroup/v1)" if need else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _used_subnets() -> set[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return {f.split("/")[0].rsplit(".", 1)[0] for f in out.split() if f.count(".") == 3}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


class SlurmCluster:
    """``SlurmCluster(base, data).start()``; ``stop()`` undoes all of it.

    ``data``: a directory whose copy every node sees, read-only, at ``self.nfs`` (an ext4
    image, one loop device per node).  ``self.store``: a tmpfs of each node's own (like
    /dev/shm, also a tmpfs of each node's own).  ``conf_extra``: lines added to slurm.conf;
    ``files``: {name: text} written next to it; ``node_setup``: shell run as root in each node
    before its slurmd starts ({name}: the node's name); ``job_container``: Slurm's
    job_container/tmpfs (a /tmp and /dev/shm of each job's own); ``node_files``: {absolute
    path: text} present on every node only (under /etc, /opt, /var/log: a writable overlay of
    the node's own covers those, so the docs' paths are used as printed and the machine's
    own /etc is never written; a text starting with #! is made executable); ``cpus``: CPUs
    each node declares (default: this machine's; more is allowed, SlurmdParameters=
    config_overrides, then best with ``task_plugin="task/none"``: task/affinity would bind
    tasks to CPUs that do not exist); ``proctrack``: Slurm's ProctrackType (proctrack/cgroup,
    or task/cgroup in ``task_plugin``: cgroup v1, see ``cgroup_missing``; slurmd makes its
    hierarchy per node, slurm_<node> in each controller, removed with the cluster);
    ``memory``: RealMemory (MiB) each node declares, with SelectTypeParameters=CR_CPU_Memory
    (memory a consumable resource: `--mem` is allocated, and task/cgroup's ConstrainRAMSpace
    makes it the job's memory cgroup limit); None: CR_CPU, `--mem` neither counted nor
    enforced."""

    def __init__(
        self,
        data: Path,
        nodes: int = 4,
        conf_extra: str = "",
        files: dict[str, str] | None = None,
        node_setup: str = "",
        job_container: bool = False,
        node_files: dict[str, str] | None = None,
        cpus: int | None = None,
        task_plugin: str = "task/affinity",
        proctrack: str = "proctrack/linuxproc",
        memory: int | None = None,
    ) -> None:
        # 0755: the user reaches the config, the munge socket, its home, the source.  Not
        # under /tmp: job_container/tmpfs gives each job a /tmp of its own.
        self.base = base = Path(tempfile.mkdtemp(prefix="shmstage-slurm-", dir="/var/tmp"))
        base.chmod(0o755)
        self.data, self.n = data, nodes
        self.conf_extra, self.files, self.node_setup = conf_extra, dict(files or {}), node_setup
        self.node_files = dict(node_files or {})
        self.cpus = cpus or os.cpu_count() or 1
        self.task_plugin, self.proctrack = task_plugin, proctrack
        self.memory = memory
        if job_container:  # each job gets a private /tmp and /dev/shm (made under BasePath)
            self.conf_extra += "\nJobContainerType=job_container/tmpfs\nPrologFlags=Contain\n"
            self.files["job_container.conf"] = f"AutoBasePath=true\nBasePath={base}/jc\n"
            # BasePath on a tmpfs of the node's own: nodes must not share it
            self.node_setup += f"\nmkdir -p {base}/jc && mount -t tmpfs jc-{{name}} {base}/jc\n"
        self.conf = base / "etc" / "slurm.conf"
        self.nfs = base / "nfs"  # each node's loop device is mounted here
        self.store = base / "store"  # each node's own tmpfs
        self.home = base / "home"
        self.bin = base / "venv" / "bin"  # shmstage as the job's user can start it
        self.munge_socket = base / "munge" / "munge.socket.2"
        tag = f"{os.getpid() % 10000:04d}{next(_SERIAL) % 100:02d}"  # unique among live ones
        self.tag = tag
        self.bridge = f"shsb{tag}"
        self.user = f"shmslurm{tag}"
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.daemons: dict[str, subprocess.Popen] = {}
        self.holders: list[subprocess.Popen] = []
        self.devs: list[str] = []
        self.user_made = False
        self.bridge_made = False
        self.image = base / "nfs.ext4"
        self.record = Record(base, self.image)  # before anything is made: see slurmstate
        if "cgroup" in proctrack + task_plugin:
            self.files.setdefault(
                "cgroup.conf", f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={CGROUP}\n"
            )
            for ctl in CGROUP_CONTROLLERS:  # rmtree rmdir's a cgroup (its files stay: EPERM)
                for name in self.names:
                    self.record.add("dirs", f"{CGROUP}/{ctl}/slurm_{name}")

    # --- set-up -----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> SlurmCluster:
        sweep()  # what a cluster whose process was killed outright left
        _watch(self)
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        for d in ("etc", "munge", "ctld", "spool", "log", "nfs", "store", "home", "ovl",
                  "nodefiles"):  # fmt: skip
            (self.base / d).mkdir(exist_ok=True)
        for path, text in self.node_files.items():  # copied into each node's overlays
            assert path.startswith(("/etc/", "/opt/", "/var/log/")), path
            f = self.base / "nodefiles" / path.lstrip("/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
            f.chmod(0o755 if text.startswith("#!") else 0o644)
        (self.base / "munge").chmod(0o755)
        for name in self.names:
            (self.base / "spool" / name).mkdir(exist_ok=True)
        self._subnet()
        self._user()
        self._venv()
        self._image()
        self._bridge()
        self._write_conf()
        self._munge()
        self._daemon(
            "slurmctld",
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
        )
        for i in range(self.n):
            self._node(i)
        self.wait_idle(timeout)

    def _subnet(self) -> None:
        used = _used_subnets()
        for _ in range(200):
            net = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
            if net not in used:
                self.net = net
                self.ctld_addr = f"{net}.1"
                self.addrs = [f"{net}.{11 + i}" for i in range(self.n)]
                return
        raise RuntimeError("no free 10.x.y.0/24 for the Slurm cluster's bridge")

    def _user(self) -> None:
        home = self.home / self.user
        self.record.add("user", self.user)
        _run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/sh",
              "--user-group", self.user])  # fmt: skip
        self.user_made = True
        pw = pwd.getpwnam(self.user)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid
        home.mkdir()
        os.chown(home, self.uid, self.gid)
        home.chmod(0o755)
        self.user_home = home

    def _venv(self) -> None:
        """A venv the job's user can start: this one's interpreter often lives under /root
        (0700), which slurmstepd, having dropped root, cannot reach (setpriv can: it still
        holds its capabilities while execve walks the path).  So: a venv of an interpreter
        of the same version the user can run, seeing this venv's packages through a .pth
        (as a node's /opt/shmstage/venv would be installed)."""
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        site = next(p for p in sys.path if p.endswith("site-packages") and sys.prefix in p)
        for py in (os.path.realpath(sys.executable), f"/usr/bin/{ver}", f"/usr/local/bin/{ver}"):
            probe = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                     "sh", "-c", f'exec "{py}" -c "import sys; print(sys.version_info[:2])"']  # fmt: skip
            out = subprocess.run(probe, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() == str(tuple(sys.version_info[:2])):
                break
        else:
            raise RuntimeError(f"no {ver} the user {self.user} can run (install {ver})")
        venv = self.base / "venv"
        _run([py, "-m", "venv", "--without-pip", str(venv)])
        (venv / "lib" / ver / "site-packages" / "shmstage-test.pth").write_text(
            f"import site; site.addsitedir({site!r})\n"  # its .pth files too (the editable install)
        )
        for name in ("shmstage", "torchrun"):  # their console scripts, on the new interpreter
            script = Path(sys.prefix) / "bin" / name
            if script.exists():
                text = script.read_text().split("\n", 1)[1]
                (venv / "bin" / name).write_text(f"#!{venv}/bin/python\n{text}")
                (venv / "bin" / name).chmod(0o755)

    def _image(self) -> None:
        size = sum(p.stat().st_size for p in self.data.rglob("*") if p.is_file())
        mib = max(32, 2 * (size >> 20) + 16)
        _run(["mkfs.ext4", "-q", "-F", "-d", str(self.data), "-O", "^has_journal",
              str(self.image), f"{mib}M"])  # fmt: skip
        for _ in range(self.n):
            out = _run(["losetup", "--find", "--show", "--read-only", "--direct-io=on",
                        str(self.image)])  # fmt: skip
            self.devs.append(out.stdout.strip())

    def _bridge(self) -> None:
        self.record.add("bridge", self.bridge)
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.bridge_made = True
        _run(["ip", "addr", "add", f"{self.ctld_addr}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        self.ctld_port = _free_port()
        b = self.base
        mem = f" RealMemory={self.memory}" if self.memory else ""
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={addr} CPUs={self.cpus}{mem} Gres=gpu:8 State=UNKNOWN"
            for name, addr in zip(self.names, self.addrs)
        )
        self.conf.write_text(
            f"""# made by tests/slurmcluster.py: a test cluster, nothing else uses it
ClusterName=shmstage{self.tag}
SlurmctldHost={host}({self.ctld_addr})
SlurmctldPort={self.ctld_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={b}/ctld
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/spool/slurmd.%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType={self.proctrack}
TaskPlugin={self.task_plugin}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters={"CR_CPU_Memory" if self.memory else "CR_CPU"}
SlurmdParameters=config_overrides
# 8 "GPUs" per node, no devices behind them: the docs' `--gpus-per-node=8` is schedulable
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=300
{self.conf_extra}
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
        )
        # gres/gpu needs a device file per GPU (Count alone registers none): 8 harmless
        # character devices stand in; without cgroups Slurm only stats them
        devs = "/dev/null,/dev/zero,/dev/full,/dev/random,/dev/urandom,/dev/tty,/dev/ptmx,/dev/kmsg"
        self.files.setdefault("gres.conf", f"Name=gpu File={devs}\n")
        for name, text in self.files.items():
            (self.conf.parent / name).write_text(text)
        (b / "etc" / "hosts").write_text(
            "127.0.0.1 localhost\n"
            + f"{self.ctld_addr} {host}\n"
            + "".join(f"{a} {n}\n" for n, a in zip(self.names, self.addrs))
        )

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a user's command runs in: this cluster's slurm.conf, the venv first."""
        path = f"{self.bin}:/usr/sbin:/usr/bin:/sbin:/bin"
        env = {"PATH": path, "SLURM_CONF": str(self.conf), "HOME": str(self.user_home),
               "USER": self.user, "LOGNAME": self.user, "LANG": "C.UTF-8"}  # fmt: skip
        if os.environ.get("PYTHONPATH"):  # the tree under test (each node has its own /run/lock)
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env.update(extra)
        return env

    def _munge(self) -> None:
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        m = self.base / "munge"
        self._daemon(
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={key}",
             f"--socket={self.munge_socket}", f"--pid-file={m}/munged.pid",
             f"--log-file={self.base}/log/munged.log", f"--seed-file={m}/munged.seed"],
        )  # fmt: skip
        self._until(lambda: self.munge_socket.exists(), 20, "munged to listen")

    def _daemon(self, name: str, argv: list[str]) -> None:
        with open(self.base / "log" / f"{name}.out", "ab") as log:
            self.daemons[name] = subprocess.Popen(
                argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "SLURM_CONF": str(self.conf)},
            )  # fmt: skip
        self.record.add("pids", self.daemons[name].pid)

    def _node(self, i: int) -> None:
        """Node i: namespaces of its own; it waits for its end of a veth pair, takes its
        address, mounts its tmpfs and its loop device, then execs slurmd (PID 1's child: when
        PID 1 is killed the kernel kills every process of the node, job steps included)."""
        name, addr, b = self.names[i], self.addrs[i], self.base
        script = f"""set -e
for _ in $(seq 400); do ip link show eth0 >/dev/null 2>&1 && break; sleep 0.05; done
ip link set lo up
ip addr add {addr}/24 dev eth0
ip link set eth0 up
hostname {name}
mount -t tmpfs -o size=256M,mode=1777 shm-{name} /dev/shm
mount -t tmpfs -o size=256M,mode=1777 store-{name} {self.store}
mount -o ro,noload {self.devs[i]} {self.nfs}
mount -t tmpfs -o size=1M,mode=1777 lock-{name} /run/lock
mount -t tmpfs -o size=16M,mode=755 ovl-{name} {b}/ovl
for d in /etc /opt /var/log; do
  u={b}/ovl/$(echo $d | tr / _)
  mkdir -p $u.up $u.work $d
  mount -t overlay -o lowerdir=$d,upperdir=$u.up,workdir=$u.work overlay-{name} $d
done
mount --bind {b}/etc/hosts /etc/hosts
cp -r {b}/nodefiles/. /
{self.node_setup.replace("{name}", name)}
slurmd -D -N {name} -f {self.conf} &
wait
"""
        with open(b / "log" / f"{name}.out", "ab") as log:
            holder = subprocess.Popen(
                ["unshare", "--fork", "--pid", "--mount-proc", "--net", "--mount", "--uts",
                 "--propagation", "private", "bash", "-c", script],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "SLURM_CONF": str(self.conf)},
            )  # fmt: skip
        self.holders.append(holder)
        init = self._until(lambda: self._init_of(holder), 20, f"{name}'s namespaces")
        self.record.add("pids", init)  # the node's PID 1: the kernel kills the rest with it
        self.record.add("pids", holder.pid)
        veth = f"shv{self.tag}{i}"
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns",
              str(init)])  # fmt: skip
        _run(["ip", "link", "set", veth, "master", self.bridge, "up"])

    @staticmethod
    def _init_of(holder: subprocess.Popen) -> int | None:
        """The host PID of the node's PID 1 once it is in its own network namespace."""
        try:
            kids = psutil.Process(holder.pid).children()
        except psutil.Error:
            return None
        if not kids:
            return None
        pid = kids[0].pid
        try:
            if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
                return None
        except OSError:
            return None
        return pid

    def init_pid(self, i: int) -> int:
        pid = self._init_of(self.holders[i])
        if pid is None:
            raise RuntimeError(f"{self.names[i]} is not running")
        return pid

    def until(self, cond, timeout: float = 60, what: str = "a condition"):
        """``cond()``'s first true value, polled; fails after ``timeout`` s with the logs."""
        return self._until(cond, timeout, what)

    def _until(self, cond, timeout: float, what: str, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            for name, p in self.daemons.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}): {self.logs()}")
            time.sleep(interval)
        raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle (registered with slurmctld)."""

        def idle():
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                env=self.env(), timeout=30,
            ).stdout.split()  # fmt: skip
            states = dict(zip(out[::2], out[1::2]))
            return all(states.get(n) in ("idle", "mix", "alloc") for n in self.names)

        self._until(idle, timeout, "the nodes to register")

    # --- use --------------------------------------------------------------------------------

    def as_user(self, argv: list[str], timeout: float = 120, env=None, cwd=None, check=True,
                **kw) -> subprocess.CompletedProcess:  # fmt: skip
        """``argv`` run on the submit host as the cluster's user (no capabilities)."""
        cmd = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
               "--inh-caps=-all", "--bounding-set=-all", *argv]  # fmt: skip
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or self.user_home,
            env=env or self.env(), **kw,
        )  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(
                f"{argv} exited {out.returncode}\nstdout: {out.stdout}\nstderr: {out.stderr}"
            )
        return out

    def sbatch(self, script: str, *args: str, env=None) -> str:
        """Submit ``script`` (bash) as the user; the job id.  Output: ``self.output(job)``."""
        path = self.user_home / f"job{random.randrange(1 << 30)}.sh"
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        os.chown(path, self.uid, self.gid)
        out = self.as_user(["sbatch", "--parsable", "--output", f"{self.user_home}/%j.out",
                            *args, str(path)], env=env)  # fmt: skip
        return out.stdout.strip().split(";")[0]

    def show(self, kind: str, name: str) -> dict[str, str]:
        """``scontrol show KIND NAME`` as {field: value} (a value may hold spaces: Reason)."""
        out = subprocess.run(
            ["scontrol", "-o", "show", kind, name], capture_output=True, text=True,
            env=self.env(), timeout=30,
        ).stdout  # fmt: skip
        return dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", out.strip()))

    def wait_job(self, job: str, timeout: float = 180) -> str:
        """Until job ``job`` has ended: its final state (COMPLETED, FAILED, CANCELLED...)."""

        def ended():
            state = self.show("job", job).get("JobState")
            return state not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING") and state

        # every poll is an scontrol process and an RPC: on 2 CPUs, 10 a second slow the jobs
        return self._until(ended, timeout, f"job {job} to end", interval=0.3)

    def output(self, job: str) -> str:
        path = self.user_home / f"{job}.out"
        return path.read_text() if path.exists() else ""

    def on_node(self, i: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """``argv`` run as root inside node i (its namespaces)."""
        cmd = ["nsenter", "-t", str(self.init_pid(i)), "-m", "-n", "-u", "-p", "--", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)

    def read(self) -> int:
        """Bytes read so far from all the nodes' loop devices (the source traffic)."""
        total = 0
        for dev in self.devs:
            stat = Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()
            total += 512 * int(stat[2])
        return total

    def logs(self) -> str:
        out = []
        for p in sorted((self.base / "log").glob("*")):
            with contextlib.suppress(OSError):
                out.append(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    # --- tear-down --------------------------------------------------------------------------

    def leftovers(self, pids: list[int]) -> list[str]:
        """What of the cluster is still there after stop(): ``pids`` alive, the bridge, a
        loop device on the image, the user, the directory."""
        left = [f"pid {p}" for p in pids if _alive(p)]
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
            left.append(f"bridge {self.bridge}")
        out = subprocess.run(["losetup", "-j", str(self.image)], capture_output=True, text=True)
        left += [f"loop device {line}" for line in out.stdout.splitlines()]
        with contextlib.suppress(KeyError):
            pwd.getpwnam(self.user)
            left.append(f"user {self.user}")
        if self.base.exists():
            left.append(f"directory {self.base}")
        return left

    def pids(self) -> list[int]:
        """Every process the cluster runs now: daemons, nodes and what runs in them."""
        pids = [p.pid for p in (*self.daemons.values(), *self.holders)]
        for holder in self.holders:
            with contextlib.suppress(psutil.Error):
                pids += [k.pid for k in psutil.Process(holder.pid).children(recursive=True)]
        return pids

    def stop(self) -> None:
        """Kill what start() started (by PID), then remove the bridge, the loop devices and
        the user; the nodes' mounts go with their namespaces."""
        pids = self.pids()
        for holder in self.holders:
            init = self._init_of(holder)
            if init is not None:  # PID 1 of the node: the kernel kills the rest of it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                holder.kill()
        for holder in self.holders:
            holder.wait()
        for p in self.daemons.values():
            if p.poll() is None:
                p.terminate()
        for p in self.daemons.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.holders, self.daemons = [], {}
        # the kernel kills a node's other processes after its PID 1, not at once
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.bridge_made:  # its veths went with the nodes' network namespaces
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self.bridge_made = False
        for dev in self.devs:
            subprocess.run(["losetup", "-d", dev], capture_output=True)
        self.devs = []
        if self.user_made:
            subprocess.run(["userdel", self.user], capture_output=True)
            self.user_made = False
        for d in self.record.data["dirs"]:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(self.base, ignore_errors=True)
        _unwatch(self)


# Clusters alive in this process, and the SIGTERM/SIGHUP handlers they replaced.
_LIVE: list[SlurmCluster] = []
_PREVIOUS: dict[int, object] = {}


def _watch(c: SlurmCluster) -> None:
    """While ``c`` lives, SIGTERM and SIGHUP stop it, then act as before (signal handlers
    belong to the main thread: pytest and `make slurm` start clusters there)."""
    _LIVE.append(c)
    if _PREVIOUS or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if previous == signal.SIG_IGN:  # nohup: the signal does not end this process
            continue
        _PREVIOUS[sig] = signal.SIG_DFL if previous is None else previous
        signal.signal(sig, _on_signal)


def _unwatch(c: SlurmCluster) -> None:
    if c in _LIVE:
        _LIVE.remove(c)
    if not _LIVE:
        for sig, previous in _PREVIOUS.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        _PREVIOUS.clear()


def _on_signal(signum: int, frame) -> None:
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    for c in list(_LIVE):
        c.stop()  # the last one restores the previous handlers
    if callable(previous):
        previous(signum, frame)
    else:  # the default action (die of the signal), now that nothing is left behind
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def main() -> int:
    """`make slurm`: start a 4-node cluster with a small dataset and wait for Ctrl-C/SIGTERM."""
    why = missing()
    if why:
        print(f"make slurm: {why}", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="shmstage-slurm-"))
    data = base / "data"
    (data / "train").mkdir(parents=True)
    for i in range(64):
        (data / "train" / f"{i:03}.bin").write_bytes(os.urandom(64 << 10))
    c = SlurmCluster(data)
    c.record.add("dirs", base)  # swept with the cluster if this process is killed outright
    stop = []
    for sig in (signal.SIGTERM, signal.SIGHUP):  # `kill`, a closed terminal: stop, clean up
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        c.start()
        print(
            f"""A Slurm cluster of {c.n} nodes ({", ".join(c.names)}) is up.
  source (each node's own read-only loop device): {c.nfs}/train
  store (each node's own tmpfs): {c.store}; each node has its own /dev/shm too
  submit as its user:   su -s /bin/sh {c.user} -c "SLURM_CONF={c.conf} PATH={c.bin}:/usr/bin:/bin srun -N 4 hostname"
  or as root:           export SLURM_CONF={c.conf}; sinfo; srun -N 4 hostname
  a shell in node1:     nsenter -t {c.init_pid(0)} -m -n -u -p
  logs: {c.base}/log
Stop it with Ctrl-C or `kill {os.getpid()}` (it removes everything it made; so does a
closed terminal; after a `kill -9`, the next cluster's start removes what this one left).""",
            flush=True,
        )
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)
        print("stopped; nothing left behind", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
