"""A stand-in `hf` for tests: huggingface_hub's real CLI, with the Hub's side of Jobs answered here.

    HF_EMU_DIR=/tmp/emu python tests/hf_jobs_emulator.py jobs run --detach ... IMAGE bash -c '...'

tests/test_jobs_emulated.py puts an `hf` that runs this file first on PATH, then runs `bash jobs.sh`.
The real CLI (huggingface_hub in .venv) parses every argument, so an option or volume spec it
would refuse is refused here too. Only the HfApi methods that would reach the Hub are replaced:
whoami, create_bucket, bucket_info, sync_bucket, batch_bucket_files (a bucket is a folder under
HF_EMU_DIR/buckets), run_job, inspect_job, cancel_job and fetch_job_logs.

How a job runs (Linux, as root, with mount and network namespaces):
1. Files: the job gets its own mount namespace and is chrooted into a root made of this machine's
   top-level folders (bind mounts) plus each volume at its mount point: the bucket's folder,
   read-only when the spec ends in `:ro`; a local folder is copied when the job is submitted (as
   `hf jobs run` uploads it) and mounted read-only, as on Jobs.
2. Environment: only what -e/-s/--secrets give, plus JOB_ID, CPU_CORES, HOME, PATH and the test's
   thread and offline settings (PASS_ENV). PATH holds bash, the core utilities and `python3`, no
   `python`. `python3` is .venv's interpreter; in an image named python:* it runs with -S (standard
   library only, like python:3.12-slim). `pip` is .venv's pip with no index and no configuration
   (no find-links): a `pip install` passes only when the packages are already installed, and
   changes nothing.
3. Network: all jobs share one network namespace with a loopback interface that also holds
   GATEWAY_IP. An exposed port's URL, https://<id>--<port>.hf.jobs, is rewritten to
   http://GATEWAY_IP:<port> in the command and environment of the jobs submitted after it: the one
   change made to a job's command. As behind the real gateway, a server bound to 127.0.0.1 cannot
   be reached that way; one bound to 0.0.0.0 can.
4. Stage: RUNNING, then COMPLETED (exit 0), ERROR (another exit status, or --timeout) or CANCELED.
No GPU: the flavour is only checked against huggingface_hub's list of flavours.
"""

import datetime
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

EMU_DIR = os.environ.get("HF_EMU_DIR", "")
USER = "emulated-user"
GATEWAY_IP = "10.233.0.1"
VENV_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "bin", "python")
PASS_ENV = ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "PYTHONUNBUFFERED",
            "VLLM_CPU_KVCACHE_SPACE"]
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
    write_json(path("netns.json"), {"pid": proc.pid})
    return proc.pid


def image_bin(image):
    """The PATH folder of an image: the tools, `python3` and `pip` (see the module docstring)."""
    kind = "python" if image.startswith("python:") else "full"
    bindir = path("image-bin", kind)
    if os.path.isdir(bindir):
        return bindir
    os.makedirs(bindir + ".tmp", exist_ok=True)
    for tool in TOOLS:
        if shutil.which(tool):
            os.symlink(os.path.realpath(shutil.which(tool)), os.path.join(bindir + ".tmp", tool))
    flag = " -S" if kind == "python" else ""
    scripts = {"python3": f'#!/bin/bash\nexec {VENV_PYTHON}{flag} "$@"\n',
               "pip": f'#!/bin/bash\nPIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 '
                      f'exec {VENV_PYTHON} -m pip "$@"\n'}  # no index, no find-links: installs nothing
    for name, text in scripts.items():
        with open(os.path.join(bindir + ".tmp", name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(bindir + ".tmp", name), 0o755)
    os.rename(bindir + ".tmp", bindir)
    return bindir


def gateway_urls(text):
    """https://<id>--<port>.hf.jobs of every exposed job -> http://GATEWAY_IP:<port>."""
    for job_id in os.listdir(path("jobs")):
        for port in read_json(path("jobs", job_id, "job.json"), {}).get("expose", []):
            text = text.replace(f"https://{job_id}--{port}.hf.jobs", f"http://{GATEWAY_IP}:{port}")
    return text


def stage(job_id):
    """(stage, message) of a job, from what its supervisor wrote."""
    result = read_json(path("jobs", job_id, "result.json"))
    if result is None:
        return "RUNNING", None
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
                   status={"stage": st, "message": message,
                           "exposeUrls": [f"https://{job_id}--{p}.hf.jobs" for p in spec["expose"]] or None},
                   expose={"ports": spec["expose"]} if spec["expose"] else None)


def run_job(self, *, image, command, env=None, secrets=None, flavor=None, timeout=None, labels=None, volumes=None,
            expose=None, namespace=None, **unused):
    from huggingface_hub import JobHardware
    from huggingface_hub.utils._parsing import parse_duration

    known = [h.value for h in JobHardware]
    if (flavor or "cpu-basic") not in known:
        raise ValueError(f"400 Bad Request: unknown flavor {flavor!r} (known: {', '.join(known)})")
    for key in ("attempts", "expose_public", "network_group", "resource_group_id"):
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
    job_env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    job_env.update({k: gateway_urls(str(v or "")) for k, v in {**(env or {}), **(secrets or {})}.items()})
    jobdir = path("jobs", job_id)
    os.makedirs(os.path.join(jobdir, "home"))
    job_env.update(PATH=image_bin(image), HOME=os.path.join(jobdir, "home"), JOB_ID=job_id,
                   CPU_CORES=str(os.cpu_count()))
    seconds = parse_duration(timeout) if isinstance(timeout, str) else (timeout or 30 * 60)
    write_json(os.path.join(jobdir, "job.json"), dict(
        image=image, command=[gateway_urls(c) for c in command], env=env or {}, secrets=sorted(secrets or {}),
        flavor=flavor or "cpu-basic", labels=labels or {}, expose=list(expose or []), mounts=mounts,
        job_env=job_env, timeout_s=seconds, netns=network(),
        created_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")))
    subprocess.Popen([sys.executable, __file__, "_supervise", jobdir], start_new_session=True, env=os.environ,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):  # until the job's process exists: a cancel right after this call must find it
        if os.path.exists(os.path.join(jobdir, "pid")):
            break
        time.sleep(0.01)
    return job_info(job_id)


def secrets_token():
    return secrets.token_hex(12)  # 24 hex characters, like a real job id


def cancel_job(self, *, job_id, **unused):
    job_info(job_id)  # 404 for an unknown id
    if stage(job_id)[0] != "RUNNING":
        return
    open(path("jobs", job_id, "canceled"), "w").close()
    with open(path("jobs", job_id, "pid")) as f:
        pgid = int(f.read())
    kill_group(pgid)


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


def fetch_job_logs(self, *, job_id, follow=False, tail=None, **unused):
    job_info(job_id)
    with open(path("jobs", job_id, "log"), errors="replace") as f:
        lines = f.read().splitlines()
        yield from lines[-tail:] if tail else lines
        while follow and stage(job_id)[0] == "RUNNING":
            line = f.readline()
            if line:
                yield line.rstrip("\n")
            else:
                time.sleep(0.2)
        yield from f.read().splitlines()


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


# ---- inside: the supervisor (outside the job) and the job's own first steps ----------------------

def supervise(jobdir):
    """Start the job in its namespaces, wait for it (up to its timeout), write result.json."""
    spec = read_json(os.path.join(jobdir, "job.json"))
    argv = ["nsenter", f"--net=/proc/{spec['netns']}/ns/net", "unshare", "--mount", "--propagation", "private",
            sys.executable, __file__, "_enter", jobdir]
    with open(os.path.join(jobdir, "log"), "ab") as log:
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    with open(os.path.join(jobdir, "pid"), "w") as f:
        f.write(str(proc.pid))
    message = None
    try:
        rc = proc.wait(timeout=spec["timeout_s"])
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, grace=5)
        rc, message = proc.wait(), f"Job timeout ({spec['timeout_s']} s)"
    kill_group(proc.pid, grace=5)  # on Jobs the container goes, and everything in it
    write_json(os.path.join(jobdir, "result.json"), {"rc": rc, "message": message})


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
        pid_file = path("jobs", job_id, "pid")
        if os.path.exists(pid_file) and stage(job_id)[0] == "RUNNING":
            kill_group(int(open(pid_file).read()), grace=2)
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
