"""A stand-in `hf` for tests: huggingface_hub's real CLI, with the Hub's side of Jobs answered here.

    HF_EMU_DIR=/tmp/emu python bench/hf_jobs_emulator.py jobs run --detach ... IMAGE bash -c '...'

tests/test_jobs_emulated.py puts an `hf` that runs this file first on PATH, then runs `bash jobs.sh`.
The real CLI (huggingface_hub in .venv) parses every argument, so an option or volume spec it
would refuse is refused here too. Only the HfApi methods that would reach the Hub are replaced:
whoami, create_bucket, bucket_info, sync_bucket, batch_bucket_files (a bucket is a folder under
HF_EMU_DIR/buckets), run_job, inspect_job, cancel_job and fetch_job_logs.

How a job runs (Linux, as root, with mount and network namespaces):
1. Files: the job gets its own mount namespace and is chrooted into a root made of this machine's
   top-level folders (bind mounts) plus each volume at its mount point; a local folder is copied
   when the job is submitted (as `hf jobs run` uploads it) and mounted read-only, as on Jobs. A
   bucket mounted read-write is the bucket's folder itself; one mounted `:ro` is a read-only view
   that shows each file another job writes after a delay drawn from HF_EMU_MOUNT_LAG (default
   "10 30" seconds; bench/bench_propagation.py's Mirror), like hf-mount's polled metadata. (Two
   read-write mounts of one bucket see each other at once: kinder than the platform.)
2. Environment: only what -e/-s/--secrets give, plus what Jobs sets (JOB_ID, ACCELERATOR,
   CPU_CORES, MEMORY) and the image's HOME and PATH: nothing of this machine's, so a test that
   needs HF_HUB_OFFLINE & co passes them as a job's -e (jobs.sh: JOB_ENV). PATH holds bash, the
   core utilities and `python3`, no `python`. `python3` is .venv's interpreter; in an image named
   python:* it runs with -S (standard library only, like python:3.12-slim). Its pip (`pip`,
   `python3 -m pip`) has no index and no configuration (no find-links): a `pip install` passes
   only when the packages are already installed, and changes nothing.
3. Network: all jobs share one network namespace (loopback, GATEWAY_IP and JOB_IP). An exposed
   port sits behind a gateway, as on Jobs: every request needs `Authorization: Bearer <the
   emulated user's HF token>` (HF_EMU_USER_TOKEN, default hf_emulated_token), else 401 (403 for a
   token in HF_EMU_FORBIDDEN_TOKENS: a real token without read access to the namespace); with
   HF_EMU_GATEWAY=strip the gateway removes Authorization before forwarding (=forward, the
   default, passes it on: which one Jobs does is what `bash jobs.sh preflight` finds out). The
   gateway forwards to JOB_IP:<port>, so a server bound to 127.0.0.1 cannot be reached; one
   bound to 0.0.0.0 can. It listens for the jobs on GATEWAY_IP and for this machine on
   127.0.0.1 (the URL `hf jobs inspect` shows); https://<id>--<port>.hf.jobs and that URL are
   rewritten to the jobs' side in the command and environment of jobs submitted later: the one
   change made to a job's command.
4. Stage: SCHEDULING (HF_EMU_SCHEDULING seconds, default 2; HF_EMU_SCHEDULING_BY_FLAVOR="a10g-large=40
   ..." gives a flavour its own: a GPU that is slow to come, a trainer that starts late), RUNNING,
   then COMPLETED (exit 0), ERROR (another exit status, or --timeout) or CANCELED.
5. Attempts (`hf jobs run --attempts N`). Read in huggingface_hub 2.4: "Maximum attempts,
   including the first run. Defaults to 1" (cli/jobs.py:492), "3 retries a failed Job up to 2
   times" (hf_api.py:12170-12172), sent as the job spec's `attempts` (_jobs_api.py:678-679), shown
   back as `retry` = attempts - 1 (_jobs_api.py:240-241); ERROR and CANCELED are terminal, "will
   not run further" (_jobs_api.py:92-93). Assumed here, as a Kubernetes Job with backoffLimit
   would do (no source says how Jobs does it): a failure is any attempt that ends with a status
   other than 0, a signal included (SIGKILL, a lost machine); the job goes back to SCHEDULING
   and runs its command again, same id, same URL, same volumes, a fresh HOME; its log goes on
   after the last attempt's lines (each attempt starts with a "===== Job started" line, which
   `hf jobs logs` leaves out as huggingface_hub does, hf_api.py:12403); a cancel never
   restarts; --timeout is one clock for the whole job, from the first attempt's start, and its
   expiry ends the job in ERROR without a new attempt.
No GPU: the flavour is only checked against huggingface_hub's list of flavours. A job on a GPU
flavour finds `nvidia-smi` on its PATH when HF_EMU_NVIDIA_SMI names a stand-in script for it.
"""

import ctypes
import datetime
import http.client
import http.server
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

EMU_DIR = os.environ.get("HF_EMU_DIR", "")
ATTEMPT_LINE = "===== Job started"  # each attempt's first log line; `hf jobs logs` leaves it out
USER = "emulated-user"
GATEWAY_IP, JOB_IP = "10.233.0.1", "10.233.0.2"
USER_TOKEN = os.environ.get("HF_EMU_USER_TOKEN", "hf_emulated_token")  # the emulated user's HF token
VENV_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "bin", "python")
NO_PIP_INDEX = "PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1"
TOOLS = ["bash", "sh", "env", "cat", "grep", "cut", "sed", "awk", "ls", "mkdir", "rm", "cp", "mv", "tr", "head",
         "tail", "sleep", "date", "dirname", "basename", "uname", "id", "true", "false", "wc", "sort", "tee",
         "touch", "readlink", "nproc", "od", "mktemp", "chmod", "ln", "find", "xargs"]


def path(*parts):
    return os.path.join(EMU_DIR, *parts)


def read_json(p, default=None):
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def write_json(p, data):
    with open(p + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(p + ".tmp", p)


def run(*argv):
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


# ---- buckets: one folder each ----------------------------------------------------------------

def bucket_dir(bucket_id, sub=""):
    return path("buckets", bucket_id, sub.strip("/"))


def from_hf_uri(uri):  # hf://buckets/ns/name/sub/dir -> (ns/name, sub/dir)
    parts = uri.removeprefix("hf://buckets/").split("/")
    return "/".join(parts[:2]), "/".join(parts[2:])


# ---- jobs ------------------------------------------------------------------------------------

def network():
    """The pid of the process holding the jobs' shared network namespace (started once)."""
    holder = read_json(path("netns.json"), {}).get("pid")
    if holder and os.path.exists(f"/proc/{holder}/ns/net"):
        return holder
    proc = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):  # until unshare has exec'd sleep inside the new namespace
        if os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
            break
        time.sleep(0.02)
    ns = ["nsenter", f"--net=/proc/{proc.pid}/ns/net", "ip"]
    run(*ns, "link", "set", "lo", "up")
    run(*ns, "addr", "add", f"{GATEWAY_IP}/32", "dev", "lo")
    run(*ns, "addr", "add", f"{JOB_IP}/32", "dev", "lo")
    write_json(path("netns.json"), {"pid": proc.pid})
    return proc.pid


def image_bin(image, gpu=False):
    """The PATH folder of an image: the tools, `python3` and `pip` (see the module docstring);
    on a GPU flavour, HF_EMU_NVIDIA_SMI as `nvidia-smi` when it is set."""
    kind = "python" if image.startswith("python:") else "full"
    smi = os.environ.get("HF_EMU_NVIDIA_SMI") if gpu else None
    kind += "-gpu" if smi else ""
    bindir = path("image-bin", kind)
    if os.path.isdir(bindir):
        return bindir
    os.makedirs(bindir + ".tmp", exist_ok=True)
    for tool in TOOLS:
        if shutil.which(tool):
            os.symlink(os.path.realpath(shutil.which(tool)), os.path.join(bindir + ".tmp", tool))
    if smi:
        os.symlink(os.path.realpath(smi), os.path.join(bindir + ".tmp", "nvidia-smi"))
    flag = " -S" if kind.startswith("python") else ""
    scripts = {"python3": f'#!/bin/bash\n{NO_PIP_INDEX} exec {VENV_PYTHON}{flag} "$@"\n',
               "pip": f'#!/bin/bash\n{NO_PIP_INDEX} exec {VENV_PYTHON} -m pip "$@"\n'}  # installs nothing
    for name, text in scripts.items():
        with open(os.path.join(bindir + ".tmp", name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(bindir + ".tmp", name), 0o755)
    os.rename(bindir + ".tmp", bindir)
    return bindir


def gateway_urls(text):
    """The URLs of every exposed port (https://<id>--<port>.hf.jobs, and the one `hf jobs inspect`
    shows on this machine) -> the gateway's address on the jobs' side."""
    for job_id in os.listdir(path("jobs")):
        for g in read_json(path("jobs", job_id, "job.json"), {}).get("gateway", []):
            inside = f"http://{GATEWAY_IP}:{g['inside']}"
            text = text.replace(f"https://{job_id}--{g['port']}.hf.jobs", inside)
            text = text.replace(f"http://127.0.0.1:{g['outside']}", inside)
    return text


def stage(job_id):
    """(stage, message) of a job, from what its supervisor wrote."""
    result = read_json(path("jobs", job_id, "result.json"))
    if result is None:
        return ("RUNNING" if os.path.exists(path("jobs", job_id, "pid")) else "SCHEDULING"), None
    if os.path.exists(path("jobs", job_id, "canceled")):
        return "CANCELED", None
    if result["rc"] == 0:
        return "COMPLETED", None
    return "ERROR", result["message"] or f"the command exited with status {result['rc']}"


def job_info(job_id):
    from huggingface_hub import JobInfo

    spec = read_json(path("jobs", job_id, "job.json"))
    if spec is None:
        raise ValueError(f"404 Not Found: no job {job_id} (hf jobs emulator)")
    st, message = stage(job_id)
    return JobInfo(id=job_id, created_at=spec["created_at"], docker_image=spec["image"], command=spec["command"],
                   environment=spec["env"], secrets={k: None for k in spec["secrets"]}, flavor=spec["flavor"],
                   labels=spec["labels"], owner={"id": "0" * 24, "name": USER, "type": "user"},
                   retry=spec["attempts"] - 1,  # what the Jobs API shows (_jobs_api.py:240)
                   status={"stage": st, "message": message,
                           "exposeUrls": [f"http://127.0.0.1:{g['outside']}"
                                          for g in spec["gateway"]] or None},
                   expose={"ports": spec["expose"]} if spec["expose"] else None)


def run_job(self, *, image, command, env=None, secrets=None, flavor=None, timeout=None, labels=None, volumes=None,
            expose=None, namespace=None, attempts=None, **unused):
    from huggingface_hub import JobHardware
    from huggingface_hub.utils._parsing import parse_duration

    known = [h.value for h in JobHardware]
    if (flavor or "cpu-basic") not in known:
        raise ValueError(f"400 Bad Request: unknown flavor {flavor!r} (known: {', '.join(known)})")
    for key in ("expose_public", "network_group", "resource_group_id"):
        if unused.get(key):
            raise NotImplementedError(f"hf jobs emulator: {key} is not emulated")
    job_id = secrets_token()
    mounts = []
    for v in volumes or []:
        if v.type != "bucket":
            raise NotImplementedError(f"hf jobs emulator: only bucket volumes, not {v.type} ({v.source})")
        local = bucket_dir(v.source, v.path or "")
        if not os.path.isdir(local):
            raise ValueError(f"404 Not Found: bucket folder hf://buckets/{v.source}/{v.path or ''} does not exist")
        mounts.append({"local": local, "mount_path": v.mount_path, "read_only": bool(v.read_only)})
    job_env = {k: gateway_urls(str(v or "")) for k, v in {**(env or {}), **(secrets or {})}.items()}
    jobdir = path("jobs", job_id)
    os.makedirs(os.path.join(jobdir, "home"))
    gpu = not (flavor or "cpu-basic").startswith("cpu")  # what ACCELERATOR holds on Jobs: a guess
    job_env.update(PATH=image_bin(image, gpu), HOME=os.path.join(jobdir, "home"), JOB_ID=job_id,
                   ACCELERATOR=flavor if gpu else "none", CPU_CORES=str(os.cpu_count()),
                   MEMORY=f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30}Gi")
    n = len(os.listdir(path("jobs")))
    gateway = [{"port": int(p), "inside": 30000 + 10 * n + k, "outside": free_port()}
               for k, p in enumerate(expose or [])]
    seconds = parse_duration(timeout) if isinstance(timeout, str) else (timeout or 30 * 60)
    write_json(os.path.join(jobdir, "job.json"), dict(
        image=image, command=[gateway_urls(c) for c in command], env=env or {}, secrets=sorted(secrets or {}),
        flavor=flavor or "cpu-basic", labels=labels or {}, expose=list(expose or []), mounts=mounts,
        gateway=gateway, attempts=int(attempts or 1),
        job_env=job_env, timeout_s=seconds, netns=network(),
        created_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")))
    open(os.path.join(jobdir, "log"), "w").close()
    sup = subprocess.Popen([sys.executable, __file__, "_supervise", jobdir], start_new_session=True,
                           env=os.environ, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=open(os.path.join(jobdir, "supervisor.log"), "w"))
    with open(os.path.join(jobdir, "supervisor"), "w") as f:
        f.write(str(sup.pid))
    return job_info(job_id)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secrets_token():
    return secrets.token_hex(12)  # 24 hex characters, like a real job id


def cancel_job(self, *, job_id, **unused):
    job_info(job_id)  # 404 for an unknown id
    if stage(job_id)[0] not in ("SCHEDULING", "RUNNING"):
        return
    open(path("jobs", job_id, "canceled"), "w").close()  # a SCHEDULING job never starts (again)
    try:
        with open(path("jobs", job_id, "pid")) as f:
            kill_group(int(f.read()))
    except FileNotFoundError:  # scheduling, or between two attempts
        pass


def kill_group(pgid, grace=10.0):
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def shown(lines):
    """The log lines `hf jobs logs` shows: not an attempt's first line (hf_api.py:12403)."""
    return [line for line in lines if not line.startswith(ATTEMPT_LINE)]


def fetch_job_logs(self, *, job_id, follow=False, tail=None, **unused):
    job_info(job_id)
    with open(path("jobs", job_id, "log"), errors="replace") as f:
        lines = shown(f.read().splitlines())
        yield from lines[-tail:] if tail else lines
        while follow and stage(job_id)[0] in ("SCHEDULING", "RUNNING"):  # until a terminal stage
            line = f.readline()
            if line:
                yield from shown([line.rstrip("\n")])
            else:
                time.sleep(0.2)
        yield from shown(f.read().splitlines())


def create_bucket(self, bucket_id, *, exist_ok=False, **unused):
    from huggingface_hub import BucketUrl, constants

    if os.path.isdir(bucket_dir(bucket_id)) and not exist_ok:
        raise ValueError(f"409 Conflict: bucket {bucket_id} exists")
    os.makedirs(bucket_dir(bucket_id), exist_ok=True)
    return BucketUrl(url=f"{constants.ENDPOINT}/buckets/{bucket_id}")


def sync_bucket(self, source, dest, **unused):  # local folder -> bucket only: what `-v DIR:/path` does
    """Make the bucket folder hold what `source` holds, in place (a job may have it mounted)."""
    dst = bucket_dir(*from_hf_uri(dest))
    shutil.copytree(source, dst, symlinks=True, dirs_exist_ok=True)
    for folder, dirs, files in os.walk(dst, topdown=False):
        for name in files + dirs:
            here = os.path.join(folder, name)
            if not os.path.lexists(os.path.join(source, os.path.relpath(here, dst))):
                shutil.rmtree(here) if os.path.isdir(here) and not os.path.islink(here) else os.remove(here)


def batch_bucket_files(self, bucket_id, add=(), **unused):
    for data, name in add:
        os.makedirs(os.path.dirname(bucket_dir(bucket_id, name)), exist_ok=True)
        with open(bucket_dir(bucket_id, name), "wb") as f:
            f.write(data)


def install():
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    HfApi.whoami = lambda self, *a, **k: {"type": "user", "name": USER, "fullname": USER, "orgs": []}
    HfApi.bucket_info = lambda self, bucket_id, **k: SimpleNamespace(id=bucket_id, private=True)
    HfApi.inspect_job = lambda self, *, job_id, **k: job_info(job_id)
    for f in (run_job, cancel_job, fetch_job_logs, create_bucket, sync_bucket, batch_bucket_files):
        setattr(HfApi, f.__name__, f)


# ---- the gateway in front of exposed ports, and the lagging read-only bucket views ------------

def enter_netns(pid, _done=threading.local()):
    """Move the calling thread into the jobs' network namespace (sockets it makes then live there)."""
    if not getattr(_done, "yes", False):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        with open(f"/proc/{pid}/ns/net") as f:
            if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns into the jobs' network namespace failed")
        _done.yes = True


class Gateway(http.server.BaseHTTPRequestHandler):
    """One exposed port: 401 without the user's HF bearer; else the request, Authorization removed
    when mode == "strip", forwarded to JOB_IP:port inside the jobs' network. Set on a subclass:
    netns (pid), port, mode."""

    protocol_version = "HTTP/1.1"
    HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}

    def handle_one_request(self):
        enter_netns(self.netns)
        super().handle_one_request()

    def reply(self, code, body, headers=()):
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        forbidden = os.environ.get("HF_EMU_FORBIDDEN_TOKENS", "").split()
        if self.headers.get("Authorization", "").removeprefix("Bearer ") in forbidden:
            return self.reply(403, b"403 Forbidden: this token has no read access to the job's "
                                   b"namespace (hf jobs emulator gateway)")
        if self.headers.get("Authorization") != f"Bearer {USER_TOKEN}":
            return self.reply(401, b"401 Unauthorized: send Authorization: Bearer <an HF token with "
                                   b"read access to the job's namespace> (hf jobs emulator gateway)")
        drop = self.HOP | ({"authorization"} if self.mode == "strip" else set())
        headers = {k: v for k, v in self.headers.items() if k.lower() not in drop}
        try:
            conn = http.client.HTTPConnection(JOB_IP, self.port, timeout=600)
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
        except OSError as e:
            return self.reply(502, f"502 Bad Gateway: nothing answers on port {self.port} ({e})".encode())
        self.reply(resp.status, data, [(k, v) for k, v in resp.getheaders()
                                       if k.lower() not in self.HOP | {"content-length"}])

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = forward

    def log_message(self, *args):
        pass


def start_gateway(spec):
    """For each exposed port: a listener on 127.0.0.1 (this machine) and one on GATEWAY_IP (the jobs)."""
    mode = os.environ.get("HF_EMU_GATEWAY", "forward")
    if mode not in ("forward", "strip"):
        sys.exit(f"hf jobs emulator: HF_EMU_GATEWAY={mode!r}: use forward or strip")
    for g in spec["gateway"]:
        handler = type("PortGateway", (Gateway,), dict(netns=spec["netns"], port=g["port"],
                                                         mode=mode))
        outside = http.server.ThreadingHTTPServer(("127.0.0.1", g["outside"]), handler)
        threading.Thread(target=outside.serve_forever, daemon=True).start()

        def inside(handler=handler, port=g["inside"]):
            enter_netns(spec["netns"])
            http.server.ThreadingHTTPServer((GATEWAY_IP, port), handler).serve_forever()

        threading.Thread(target=inside, daemon=True).start()


def start_views(spec, jobdir):
    """Each `:ro` bucket mount becomes a view of the bucket's folder that lags (module docstring)."""
    from bench_propagation import Mirror  # bench/: the mount that lags like hf-mount

    lag = [float(x) for x in os.environ.get("HF_EMU_MOUNT_LAG", "10 30").split()]
    mirrors = []
    for k, m in enumerate(spec["mounts"]):
        if m["read_only"]:  # the code folder too: it never changes, so only its start shows
            view = os.path.join(jobdir, "views", str(k))
            shutil.copytree(m["local"], view, symlinks=True)  # what is there at the start shows at once
            mirrors.append(Mirror(m["local"], view, lag, seed=k, sub=""))
            m["local"] = view
    return mirrors


# ---- inside: the supervisor (outside the job) and the job's own first steps ----------------------

def supervise(jobdir):
    """SCHEDULING, then start the job in its namespaces and wait for it (up to its timeout); a
    failed attempt with attempts left is scheduled and started again (module docstring, 5);
    then write result.json. The gateway and the bucket views live as long as this process."""
    spec = read_json(os.path.join(jobdir, "job.json"))
    canceled = os.path.join(jobdir, "canceled")
    by_flavor = dict(w.split("=", 1) for w in os.environ.get("HF_EMU_SCHEDULING_BY_FLAVOR", "").split())
    scheduling = float(by_flavor.get(spec["flavor"], os.environ.get("HF_EMU_SCHEDULING", "2")))
    for attempt in range(1, spec["attempts"] + 1):
        time.sleep(scheduling)
        if os.path.exists(canceled):
            return write_json(os.path.join(jobdir, "result.json"), {"rc": -15, "message": None})
        if attempt == 1:
            start_gateway(spec)
            start_views(spec, jobdir)
            write_json(os.path.join(jobdir, "job.json"), spec)  # the mounts as the job sees them
            deadline = time.time() + spec["timeout_s"]  # one clock for every attempt (assumed)
        else:  # a new container: nothing of the last attempt's home
            shutil.rmtree(spec["job_env"]["HOME"])
            os.makedirs(spec["job_env"]["HOME"])
        rc, message = run_attempt(jobdir, spec, attempt, deadline)
        if rc == 0 or message or os.path.exists(canceled):
            break
        os.remove(os.path.join(jobdir, "pid"))  # SCHEDULING again
    write_json(os.path.join(jobdir, "result.json"), {"rc": rc, "message": message})


def run_attempt(jobdir, spec, attempt, deadline):
    """Run the job's command once: (exit status, the timeout's message or None)."""
    argv = ["nsenter", f"--net=/proc/{spec['netns']}/ns/net", "unshare", "--mount", "--propagation", "private",
            sys.executable, __file__, "_enter", jobdir]
    with open(os.path.join(jobdir, "log"), "ab") as log:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        log.write(f"{ATTEMPT_LINE} at {now} (attempt {attempt} of {spec['attempts']}) =====\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    with open(os.path.join(jobdir, "pid"), "w") as f:
        f.write(str(proc.pid))
    if os.path.exists(os.path.join(jobdir, "canceled")):  # cancelled while this job was starting
        kill_group(proc.pid, grace=5)
    message = None
    try:
        rc = proc.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, grace=5)
        rc, message = proc.wait(), f"Job timeout ({spec['timeout_s']} s)"
    kill_group(proc.pid, grace=5)  # on Jobs the container goes, and everything in it
    return rc, message


def enter(jobdir):
    """In the job's new mount namespace: build its root, chroot into it, exec its command."""
    spec = read_json(os.path.join(jobdir, "job.json"))
    root = os.path.join(jobdir, "root")
    os.makedirs(root, exist_ok=True)
    run("mount", "-t", "tmpfs", "tmpfs", root)
    tops = {m["mount_path"].strip("/").split("/")[0] for m in spec["mounts"]}
    for name in sorted(set(os.listdir("/")) - tops):
        src, dst = "/" + name, os.path.join(root, name)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            os.mkdir(dst)
            run("mount", "--rbind", src, dst)
    for m in spec["mounts"]:
        dst = root + m["mount_path"]
        os.makedirs(dst, exist_ok=True)
        run("mount", "--bind", m["local"], dst)
        if m["read_only"]:
            run("mount", "-o", "remount,bind,ro", dst)
    os.chroot(root)
    os.chdir("/")
    os.execvpe(spec["command"][0], spec["command"], spec["job_env"])


def teardown():
    """Kill every job still running and the network holder (the test's cleanup)."""
    for job_id in os.listdir(path("jobs")) if os.path.isdir(path("jobs")) else []:
        open(path("jobs", job_id, "canceled"), "a").close()  # a job still SCHEDULING never starts
        pid_file = path("jobs", job_id, "pid")
        if os.path.exists(pid_file) and stage(job_id)[0] == "RUNNING":
            kill_group(int(open(pid_file).read()), grace=2)
        if os.path.exists(path("jobs", job_id, "supervisor")):  # its gateway and bucket views
            kill_group(int(open(path("jobs", job_id, "supervisor")).read()), grace=2)
    holder = read_json(path("netns.json"), {}).get("pid")
    if holder:
        try:
            os.kill(holder, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main():
    if sys.argv[1:2] == ["_supervise"]:
        return supervise(sys.argv[2])
    if sys.argv[1:2] == ["_enter"]:
        return enter(sys.argv[2])
    if not EMU_DIR:
        sys.exit("hf jobs emulator: set HF_EMU_DIR to the folder that holds the emulated buckets and jobs")
    os.makedirs(path("jobs"), exist_ok=True)
    if sys.argv[1:2] == ["_teardown"]:
        return teardown()
    os.environ["HF_HUB_DISABLE_UPDATE_CHECK"] = "1"
    install()
    from huggingface_hub.cli.hf import main as hf_main

    sys.argv[0] = "hf"
    return hf_main()


if __name__ == "__main__":
    sys.exit(main())
