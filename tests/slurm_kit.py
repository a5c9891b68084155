"""A real, local, fake-GPU Slurm cluster on this one host, for integration tests.

``LocalSlurm`` writes a private ``slurm.conf``/``gres.conf`` under a fresh directory, starts one
``slurmctld`` and one ``slurmd`` per node (``slurmd -N n1 ...``; all on 127.0.0.1, each on a free TCP
port picked at run time) and waits until ``sinfo`` shows every node idle. Every node declares its
GPUs as one GRES *type* per index (``gpu:g0``, ``gpu:g1``, ...) backed by symlinks to ``/dev/null``,
so a job can ask for exact GPUs: ``sbatch -w n2 --gres=gpu:g1:1,gpu:g3:1`` runs on n2 with
``CUDA_VISIBLE_DEVICES=1,3``.

No cgroups (proctrack/linuxproc, task/none), no slurmdbd (accounting_storage/none), job completion
records in a text file (jobcomp/filetxt, readable with ``sacct --completion``). MUNGE: the system
daemon is used when ``munge -n | unmunge`` works; otherwise the kit runs a private ``munged`` with
its own key and socket under ``root`` and points Slurm at it (``AuthInfo=socket=...``), so the
system's MUNGE setup is never touched.

``stop()`` cancels every job, then ends only the processes the kit started (by PID) plus any
process whose environment carries this cluster's ``SLURM_CONF`` (slurmstepd and job processes).
Never by name: other Slurm instances may run on the same host.

Usage::

    with LocalSlurm(Path(tempfile.mkdtemp(prefix="slk", dir="/tmp"))) as slurm:
        job = slurm.sbatch("#!/bin/sh\\necho $CUDA_VISIBLE_DEVICES", "-w", "n2", "--gres=gpu:g1:1")
        slurm.wait_job(job, {"COMPLETED"})

or the ``local_slurm()`` context manager / ``slurm_fixture()`` pytest fixture factory below, which
also make (and remove) a short temporary root.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

SYSTEM_MUNGE_SOCKET = "/run/munge/munge.socket.2"
# Slurm keeps unix sockets in SlurmdSpoolDir (sun_path is at most 107 bytes): keep roots short.
MAX_ROOT_LEN = 60
# Job states after which a job never runs again.
FINISHED_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                             "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"})
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
# Log lines every start-up produces (Debian's build loads mpi/pmix without libpmix; fresh state dir).
_LOG_NOISE = re.compile(r"pmix|MPI: Cannot create context|state file|Trying backup state save file")
_SCRUB_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SACCT_", "SCONTROL_", "SCANCEL_")
_SCRUB_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"})


class SlurmKitError(RuntimeError):
    """The local cluster could not be started, or a Slurm command failed."""


def _which(tool: str) -> str:
    path = shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(_SBIN))
    if path is None:
        raise SlurmKitError(f"{tool} not found on PATH; run scripts/install_slurm.sh (as root)")
    return path


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on every address right now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))  # "" (INADDR_ANY), so the port is also free on 127.0.0.1
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, lines: int, skip: re.Pattern[str] | None = None) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(missing)"
    if skip is not None:
        text = [line for line in text if not skip.search(line)]
    return "\n".join(text[-lines:]) or "(empty)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie that is not ours to reap still counts as gone.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job -o`` / ``show node -o`` output (one record) as a dict.

    Values may contain spaces only in a few fields (e.g. ``Reason``); a key is a word followed by
    ``=`` at a space boundary, so values keep their inner spaces.
    """
    out: dict[str, str] = {}
    for match in re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)", text.strip()):
        out[match.group(1)] = match.group(2)
    return out


class LocalSlurm:
    """A local Slurm cluster of ``nodes`` fake nodes with ``gpus_per_node`` typed fake GPUs each.

    Attributes: ``root``, ``conf_path`` (``root/slurm.conf``), ``nodes`` (``["n1", ...]``),
    ``gpus_per_node``, ``cpus_per_node``, ``partition``, ``cluster_name``, ``hostname``,
    ``log_dir`` (daemon logs), ``jobcomp_path`` (jobcomp/filetxt records), ``env`` (environment for
    Slurm client commands: ``os.environ`` without ``SLURM_*``/``SBATCH_*``/``SQUEUE_*``/...,
    ``CUDA_VISIBLE_DEVICES`` and the like, plus ``SLURM_CONF``); after ``start()`` also ``ctld_port``,
    ``node_ports`` (name -> port), ``munge_socket`` (None when the system MUNGE is used),
    ``startup_seconds`` and ``pids`` (daemon name -> PID).

    ``conf`` replaces or adds top-level ``slurm.conf`` keys (e.g. ``{"MinJobAge": "30"}``);
    ``extra_conf`` is appended verbatim (e.g. more ``PartitionName=`` lines).
    """

    def __init__(self, root: Path | str, nodes: int = 3, gpus_per_node: int = 4, *, cpus_per_node: int = 8,
                 real_memory_mb: int = 1024, partition: str = "debug", cluster_name: str = "themis-test",
                 min_job_age: int = 300, kill_wait: int = 5, start_timeout: float = 30.0,
                 conf: Mapping[str, str] | None = None, extra_conf: str = "") -> None:
        if nodes < 1 or gpus_per_node < 0:
            raise ValueError("need nodes >= 1 and gpus_per_node >= 0")
        self.root = Path(root).resolve()
        if len(str(self.root)) > MAX_ROOT_LEN:
            raise ValueError(f"root {self.root} is too long for Slurm's unix sockets (max {MAX_ROOT_LEN} chars)")
        self.nodes = [f"n{k}" for k in range(1, nodes + 1)]
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        self.real_memory_mb = real_memory_mb
        self.partition = partition
        self.cluster_name = cluster_name
        self.min_job_age = min_job_age
        self.kill_wait = kill_wait
        self.start_timeout = start_timeout
        self.conf_overrides = dict(conf or {})
        self.extra_conf = extra_conf
        self.startup_seconds: float | None = None
        self.hostname = socket.gethostname().split(".")[0]
        self.conf_path = self.root / "slurm.conf"
        self.log_dir = self.root / "log"
        self.jobcomp_path = self.root / "jobcomp.txt"
        self.ctld_port = 0
        self.node_ports: dict[str, int] = {}
        self.munge_socket: str | None = None  # None: the system socket
        # Client environment: nothing inherited that would steer Slurm commands elsewhere or leak a GPU
        # selection into jobs (sbatch exports the submitter's environment by default).
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
        self.env["SLURM_CONF"] = str(self.conf_path)
        path = self.env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
        self.env["PATH"] = os.pathsep.join(path + [d for d in _SBIN if d not in path])
        self._procs: dict[str, subprocess.Popen] = {}  # name -> daemon started by us
        self._started = False

    @property
    def pids(self) -> dict[str, int]:
        """PIDs of the live daemons this kit started: ``slurmctld``, ``slurmd-n1``, ..., maybe ``munged``."""
        return {name: proc.pid for name, proc in self._procs.items() if proc.poll() is None}

    # ----------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalSlurm:
        if self._started:
            return self
        self._started = True
        t0 = time.monotonic()
        try:
            for tool in ("slurmctld", "slurmd", "sbatch", "munge", "unmunge"):
                _which(tool)
            self.root.mkdir(parents=True, exist_ok=True)
            self.root.chmod(0o755)  # munged insists on a world-searchable socket path
            self.log_dir.mkdir(exist_ok=True)
            self._start_munge()
            for attempt in range(3):
                try:
                    self._start_slurm(t0 + self.start_timeout)
                    break
                except SlurmKitError as err:
                    # A port picked as free was taken before the daemon bound it: retry with new ports.
                    if "Address already in use" not in str(err) or attempt == 2:
                        raise
                    self._end_daemons([n for n in self._procs if n != "munged"])
                    shutil.rmtree(self.root / "state", ignore_errors=True)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _start_slurm(self, deadline: float) -> None:
        self._write_config()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf_path)])
        # slurmd's first registration attempt must reach slurmctld, else it retries only seconds later.
        self._wait_ctld_listening(deadline)
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf_path)])
        self._wait_idle(deadline)

    def stop(self) -> None:
        """Cancel all jobs, end the daemons this kit started (by PID) and leftover job processes."""
        if not self._started:
            return
        self._started = False
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(Exception):
                self.run("scancel", "--full", "--signal=KILL", "--user", str(os.getuid()), check=False, timeout=10)
                self.run("scancel", "--user", str(os.getuid()), check=False, timeout=10)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and self._job_processes():
                    time.sleep(0.1)
        # Daemons: slurmd's first, then slurmctld, munged last.
        self._end_daemons([n for n in self._procs if n.startswith("slurmd-")])
        self._end_daemons(["slurmctld"])
        self._end_daemons(list(self._procs))
        # slurmstepd and job processes outlive slurmd (they are not its children).
        leftovers = self._job_processes()
        for pid in leftovers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_pid_alive(p) for p in leftovers):
            time.sleep(0.05)

    def _end_daemons(self, names: list[str]) -> None:
        """SIGTERM the named daemons we started (by PID), SIGKILL after 10 s, reap them."""
        procs = [self._procs.pop(n) for n in names if n in self._procs]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=10)

    # --------------------------------------------------------------------------------- client side
    def run(self, *args: str, check: bool = True, timeout: float = 30.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``sbatch``, ``squeue``, ...) against this cluster."""
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout,
                              input=input, cwd=self.root)
        if check and proc.returncode != 0:
            raise SlurmKitError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}")
        return proc

    def sbatch(self, script: str, *args: str) -> int:
        """Submit ``script`` (text, starting with ``#!``) with extra ``sbatch`` args; returns the job id.

        Default output file is ``<root>/job-%j.out`` unless ``-o``/``--output`` is given.
        """
        extra = list(args)
        if not any(a == "-o" or a.startswith(("--output", "-o")) for a in extra):
            extra = ["-o", str(self.root / "job-%j.out"), *extra]
        out = self.run("sbatch", "--parsable", *extra, input=script).stdout.strip()
        return int(out.split(";")[0])

    def job_output(self, job_id: int) -> str:
        """The job's output file, for jobs submitted by ``sbatch()`` without their own ``-o``."""
        path = self.root / f"job-{job_id}.out"
        return path.read_text() if path.exists() else ""

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o <id>`` as a dict (``JobState``, ``ExitCode``, ``NodeList``, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return parse_scontrol(out)

    def job_state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "")

    def wait_job(self, job_id: int, states: Iterable[str] = FINISHED_STATES, timeout: float = 30.0,
                 poll: float = 0.1) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; returns its ``scontrol`` record."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in wanted:
                return info
            if time.monotonic() > deadline:
                raise SlurmKitError(f"job {job_id} not in {sorted(wanted)} after {timeout}s: {info}\n"
                                    f"{self.logs_tail()}")
            time.sleep(poll)

    def cancel_all(self) -> None:
        """``scancel`` every job of this user on this cluster."""
        self.run("scancel", "--user", str(os.getuid()), check=False)

    @staticmethod
    def gpu_gres(indexes: Iterable[int]) -> str:
        """``--gres`` value for exact GPU indexes: ``[1, 3]`` -> ``gpu:g1:1,gpu:g3:1``."""
        return ",".join(f"gpu:g{i}:1" for i in indexes)

    def logs_tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of every daemon log, without the usual harmless noise."""
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- {path.name} ---\n{_tail(path, lines, skip=_LOG_NOISE)}")
        return "\n".join(parts)

    # ------------------------------------------------------------------------------------ internals
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = dict(self.env)
        out = open(self.log_dir / f"{name}.stdout", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.root, start_new_session=True)
        finally:
            out.close()
        self._procs[name] = proc
        return proc

    def _munge_works(self, socket_path: str) -> bool:
        sock = ["-S", socket_path]
        try:
            cred = subprocess.run([_which("munge"), "-n", *sock], capture_output=True, timeout=5)
            if cred.returncode != 0:
                return False
            check = subprocess.run([_which("unmunge"), *sock], input=cred.stdout, capture_output=True, timeout=5)
        except (subprocess.TimeoutExpired, OSError):
            return False
        return check.returncode == 0

    def _start_munge(self) -> None:
        if self._munge_works(SYSTEM_MUNGE_SOCKET):
            self.munge_socket = None  # Slurm's default AuthInfo socket
            return
        # A private munged (own key, own socket) rather than the system one: nothing shared to break.
        mdir = self.root / "munge"
        mdir.mkdir(mode=0o755, exist_ok=True)
        key = mdir / "munge.key"
        if not key.exists():
            subprocess.run([_which("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True, timeout=30)
        sock = str(mdir / "munge.sock")
        self._spawn("munged", [_which("munged"), "-F", f"--socket={sock}", f"--key-file={key}",
                               f"--pid-file={mdir / 'munged.pid'}", f"--seed-file={mdir / 'munged.seed'}",
                               f"--log-file={self.log_dir / 'munged.log'}"])
        deadline = time.monotonic() + 10
        while not self._munge_works(sock):
            if self._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmKitError(f"private munged did not start:\n{_tail(self.log_dir / 'munged.stdout', 20)}")
            time.sleep(0.05)
        self.munge_socket = sock

    def _write_config(self) -> None:
        ports = _free_ports(1 + len(self.nodes))
        self.ctld_port = ports[0]
        self.node_ports = dict(zip(self.nodes, ports[1:], strict=True))
        r = self.root
        (r / "state").mkdir(exist_ok=True)
        (r / "spool").mkdir(exist_ok=True)
        (r / "plugstack.conf").write_text("")  # keep /etc/slurm/plugstack.conf.d out of the test cluster
        gpu_types = [f"gpu:g{i}:1" for i in range(self.gpus_per_node)]
        gres_lines = []
        for name in self.nodes:
            (r / "spool" / name).mkdir(exist_ok=True)
            dev = r / "dev" / name
            dev.mkdir(parents=True, exist_ok=True)
            for i in range(self.gpus_per_node):
                link = dev / f"nvidia{i}"
                if not link.is_symlink():
                    link.symlink_to("/dev/null")  # slurmd wants a character device
                gres_lines.append(f"NodeName={name} Name=gpu Type=g{i} File={link}")
        (r / "gres.conf").write_text("AutoDetect=off\n" + "\n".join(gres_lines) + "\n")

        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            *([f"AuthInfo=socket={self.munge_socket}"] if self.munge_socket else []),
            "CommunicationParameters=NoInAddrAny",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmdPidFile={r / 'spool' / '%n' / 'slurmd.pid'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            "SlurmdParameters=config_overrides",  # trust the fake CPUs/RealMemory below
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp_path}",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "GresTypes=gpu",
            "ReturnToService=2",
            f"MinJobAge={self.min_job_age}",
            f"KillWait={self.kill_wait}",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=300",
            "Waittime=0",
            # The default (3 s) delays every batch job start by up to 3 s; with 0 a submitted job starts at the
            # controller's next 1 s tick. (The very first job after start-up still waits ~3 s.)
            "SchedulerParameters=batch_sched_delay=0",
        ]
        overrides = dict(self.conf_overrides)
        for k, line in enumerate(lines):
            key = line.split("=", 1)[0]
            if key in overrides:
                lines[k] = f"{key}={overrides.pop(key)}"
        lines += [f"{key}={value}" for key, value in overrides.items()]
        lines.append(self.extra_conf)
        gres = f" Gres={','.join(gpu_types)}" if gpu_types else ""
        for name in self.nodes:
            lines.append(f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={self.node_ports[name]} "
                         f"CPUs={self.cpus_per_node} Boards=1 SocketsPerBoard=1 CoresPerSocket={self.cpus_per_node} "
                         f"ThreadsPerCore=1 RealMemory={self.real_memory_mb}{gres} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf_path.write_text("\n".join(line for line in lines if line) + "\n")

    def _check_daemons(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise SlurmKitError(f"{name} exited with {proc.returncode} during start-up\n"
                                    f"{_tail(self.log_dir / f'{name}.stdout', 20)}\n{self.logs_tail()}")

    def _wait_ctld_listening(self, deadline: float) -> None:
        while True:
            self._check_daemons()
            if self.run("scontrol", "ping", check=False, timeout=10).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise SlurmKitError(f"slurmctld not listening on port {self.ctld_port} after {self.start_timeout}s\n"
                                    f"{self.logs_tail()}")
            time.sleep(0.05)

    def _wait_idle(self, deadline: float) -> None:
        last = ""
        while True:
            self._check_daemons()
            res = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
            if res.returncode == 0:
                last = res.stdout.strip()
                states = dict(line.split() for line in last.splitlines() if line.strip())
                if all(states.get(n) == "idle" for n in self.nodes):
                    return
                bad = {n: st for n, st in states.items() if st.rstrip("*~#!%$@^-") in ("inval", "drain", "drained")}
                if bad:  # slurmctld rejected a node's registration: waiting will not help
                    raise SlurmKitError(f"nodes rejected by slurmctld: {bad}\n{self.logs_tail()}")
            else:
                last = res.stderr.strip()
            if time.monotonic() > deadline:
                raise SlurmKitError(f"cluster not idle after {self.start_timeout}s; sinfo: {last!r}\n"
                                    f"{self.logs_tail()}")
            time.sleep(0.1)

    def _job_processes(self) -> list[int]:
        """PIDs whose environment carries this cluster's SLURM_CONF: slurmstepd's and job processes.

        Leaves out this process, the daemons we started and their direct children (slurmscriptd).
        """
        marker = f"SLURM_CONF={self.conf_path}".encode()
        mine = {os.getpid()} | {p.pid for p in self._procs.values() if p.poll() is None}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in mine:
                continue
            try:
                env = (entry / "environ").read_bytes()
                if marker not in env.split(b"\0"):
                    continue
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid not in mine and _pid_alive(int(entry.name)):
                found.append(int(entry.name))
        return found


@contextlib.contextmanager
def local_slurm(nodes: int = 3, gpus_per_node: int = 4, *, keep_root: bool = False, **kwargs) -> Iterator[LocalSlurm]:
    """A started ``LocalSlurm`` in a fresh short ``/tmp/slk*`` root, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="slk", dir="/tmp"))
    try:
        with LocalSlurm(root, nodes, gpus_per_node, **kwargs) as cluster:
            yield cluster
    finally:
        if not keep_root:
            shutil.rmtree(root, ignore_errors=True)


def slurm_fixture(scope: str = "module", **kwargs):
    """A pytest fixture yielding a started ``LocalSlurm``: ``slurm = slurm_fixture("module", nodes=3)``."""
    import pytest

    @pytest.fixture(scope=scope)
    def _slurm() -> Iterator[LocalSlurm]:
        with local_slurm(**kwargs) as cluster:
            yield cluster

    return _slurm
