"""The locked-down service (issue 33, item 5): every unit as the dedicated user in a sandbox that
`systemd-analyze security` (the real one, offline) rates at most 4.0; the env file 0600 owned by that user; the
GPU and RoCE devices still reachable; docs/SECURITY.md's tables equal to what the units set and deploy installs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from dsv41.ops.deploy import Deploy, Options
from dsv41.ops.units import render_units, support_file

REPO = Path(__file__).resolve().parents[1]
SECURITY = REPO / "docs" / "SECURITY.md"
MAX_EXPOSURE = 4.0
SHORT = {"rank": "dsv41@.service", "warm": "dsv41-warm@.service", "watchdog": "dsv41-watchdog.service",
         "boot": "dsv41-boot.service"}


def service_sections() -> dict[str, dict[str, list[str]]]:
    """unit -> [Service] key -> values, for every rendered .service."""
    out = {}
    for name, text in render_units().items():
        if not name.endswith(".service"):
            continue
        values: dict[str, list[str]] = {}
        section = None
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line
            elif section == "[Service]" and line and not line.startswith("#"):
                key, _, value = line.partition("=")
                values.setdefault(key, []).append(value)
        out[name] = values
    return out


def tool_or_skip(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not installed (apt-get install systemd; .ci/run installs it)"
        print(reason)
        pytest.skip(reason)
    return path


# ------------------------------------------------------------------------------------------ systemd-analyze

def test_every_unit_rates_at_most_4_with_systemd_analyze(tmp_path):
    """Today's units ran as root with no sandbox: 9.6 UNSAFE."""
    analyze = tool_or_skip("systemd-analyze")
    rendered = render_units()
    services = [name for name in rendered if name.endswith(".service")]
    assert set(services) == set(SHORT.values())
    for name in services:
        # an instance name for the templates (security needs a loadable unit, not a template)
        path = tmp_path / name.replace("@.", "@rank0.")
        path.write_text(rendered[name])
        result = subprocess.run([analyze, "security", "--offline=true", f"--threshold={int(MAX_EXPOSURE * 10)}",
                                 "--no-pager", str(path)], capture_output=True, text=True, timeout=120)
        match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
        assert match, result.stdout[-2000:] + result.stderr
        exposure = float(match.group(1))
        print(f"{path.name}: exposure {exposure}")
        assert exposure <= MAX_EXPOSURE, f"{name}: {exposure}\n{result.stdout}"
        assert result.returncode == 0, result.stderr  # --threshold: above it systemd-analyze itself fails


def test_units_run_as_the_service_user_without_privileges():
    for name, service in service_sections().items():
        one = {key: values[-1] for key, values in service.items()}
        assert one["User"] == "dsv41" and one["Group"] == "dsv41", name
        assert one["NoNewPrivileges"] == "yes" and one["CapabilityBoundingSet"] == "", name
        assert one["ProtectSystem"] == "strict" and one["ProtectHome"] == "yes" and one["PrivateTmp"] == "yes", name
        assert one["SystemCallFilter"] == "@system-service", name
        assert "RestrictAddressFamilies" in one and "RemoveIPC" not in one, name  # one user: IPC is shared
        assert one["StateDirectory"] == "dsv41", name  # the only writable places: state and cache directories
        assert "ReadWritePaths" not in one, name


def test_the_ranks_keep_the_gpu_roce_and_the_network():
    services = service_sections()
    for name in (SHORT["rank"], SHORT["warm"]):
        service = services[name]
        assert service["DevicePolicy"] == ["closed"]
        allowed = service["DeviceAllow"]
        assert "char-nvidia* rw" in allowed, name  # nvidiactl, nvidiaN, nvidia-uvm, nvidia-caps
        assert "char-infiniband_verbs rw" in allowed and "/dev/infiniband/rdma_cm rw" in allowed, name
        assert set(service["RestrictAddressFamilies"][-1].split()) >= {"AF_INET", "AF_INET6", "AF_UNIX",
                                                                       "AF_NETLINK"}, name
        assert "PrivateDevices" not in service and "PrivateNetwork" not in service, name
    assert services[SHORT["rank"]]["LimitMEMLOCK"] == ["infinity"]


def test_service_user_file_is_valid_for_systemd_sysusers(tmp_path):
    sysusers = tool_or_skip("systemd-sysusers")
    conf = tmp_path / "dsv41.conf"
    conf.write_text(support_file("dsv41.sysusers"))
    (tmp_path / "root" / "etc").mkdir(parents=True)
    result = subprocess.run([sysusers, f"--root={tmp_path / 'root'}", str(conf)], capture_output=True, text=True,
                            timeout=60)
    problems = [line for line in result.stderr.splitlines() if line and not line.startswith("Creating ")]
    assert result.returncode == 0 and not problems, result.stderr
    passwd = (tmp_path / "root" / "etc" / "passwd").read_text().splitlines()
    user = next(line.split(":") for line in passwd if line.startswith("dsv41:"))
    assert user[5:] == ["/var/lib/dsv41", "/bin/sh"]
    group = (tmp_path / "root" / "etc" / "group").read_text()
    assert re.search(r"^video:x:\d+:dsv41$", group, re.M)


def test_polkit_rule_allows_the_dsv41_units_only():
    rule = support_file("dsv41.rules")
    assert 'subject.user != "dsv41"' in rule and "org.freedesktop.systemd1.manage-units" in rule
    pattern = re.search(r"/(\^dsv41.*?\$)/", rule).group(1)
    js_to_py = pattern.replace("\\.", r"\.")
    for unit in ("dsv41@rank0.service", "dsv41@rank1.service", "dsv41-warm@rank1.service"):
        assert re.fullmatch(js_to_py, unit), unit
    for unit in ("sshd.service", "dsv41-watchdog.service", "dsv41@rank0.service.d", "xdsv41@rank0.service"):
        assert not re.fullmatch(js_to_py, unit), unit


# ------------------------------------------------------------------------------------------ docs == units, deploy

def doc_table(heading_words: str) -> list[list[str]]:
    """The rows (cells without backticks) of the first table after the line containing `heading_words`."""
    lines = SECURITY.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if heading_words in line)
    rows = []
    for line in lines[start:]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not set(cells[0]) <= set("- "):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # without the header


def test_security_md_sandbox_table_is_what_the_units_set():
    services = service_sections()
    documented: dict[tuple[str, str], str] = {}
    for directive, value, units in doc_table("What the units set:"):
        names = list(SHORT.values()) if units == "all" else [SHORT[u.strip()] for u in units.split(",")]
        keys = re.findall(r"`(\w+)=`", directive)
        assert keys, directive
        values = re.findall(r"`([^`]*)`", value) or [""]  # "empty" cells: no backticked value
        for key in keys:
            for name in names:
                documented[(name, key)] = " ".join(values) if key == "DeviceAllow" else values[0]
                got = services[name].get(key)
                assert got, f"SECURITY.md says {name} sets {key}="
                want = values if key == "DeviceAllow" else [values[0]]
                assert got == want, f"{name}: {key}={got}, SECURITY.md says {want}"
    # and every sandbox directive a unit sets is in the table
    sandbox = {"User", "Group", "UMask", "NoNewPrivileges", "CapabilityBoundingSet", "AmbientCapabilities",
               "SupplementaryGroups", "DevicePolicy", "DeviceAllow", "PrivateDevices", "MemoryDenyWriteExecute",
               "RestrictAddressFamilies", "StateDirectory", "CacheDirectory", "LimitMEMLOCK"}
    sandbox |= {key for service in services.values() for key in service
                if key.startswith(("Protect", "Private", "Restrict", "SystemCall", "Lock", "Keyring"))}
    for name, service in services.items():
        for key in sandbox & set(service):
            assert (name, key) in documented, f"{name} sets {key}= but SECURITY.md's table does not say so"


def test_security_md_files_table_is_what_deploy_installs():
    lines: list[str] = []

    def never(*args, **kwargs):
        raise AssertionError("a dry run runs nothing")

    opts = Options(head="root@spark-a", worker="root@spark-b", flake="/src", dry_run=True,
                   config=REPO / "config" / "dsv41.env.example")
    assert Deploy(opts, run=never, out=lines.append).execute() == 0
    installed: dict[str, tuple[str, str]] = {}
    for line in lines:
        match = re.match(r"\[\d+\] \S+: install (.*?)(  |$)", line)
        if not match:
            continue
        words = match.group(1).split()
        path = words[-1]
        owner = words[words.index("-o") + 1] if "-o" in words else "root"
        mode = words[words.index("-m") + 1]
        assert installed.setdefault(path, (owner, mode)) == (owner, mode), f"{path}: installed two ways"
    documented = {path.strip("`"): (owner.strip("`"), mode.strip("`"))
                  for path, owner, mode, _ in doc_table("What deploy installs")}
    assert installed == documented
    assert installed["/etc/dsv41/dsv41.env"] == ("dsv41", "0600")  # it holds DSV41_TP_SECRET (was 0644)


# ------------------------------------------------------------------------------------------ ops code as the user

def test_watchdog_sees_a_start_lock_it_cannot_write():
    """deploy's gate runs `flock /var/lib/dsv41/start.lock ...` as root: the file is root's, 0644. The watchdog
    (the service user) opened it for appending, failed, and took the lock for free: it healed during a deploy."""
    import fcntl

    from dsv41.ops.watchdog import lock_held

    folder = Path(tempfile.mkdtemp(prefix="dsv41-lock-"))  # reachable by an unprivileged user (pytest's is not)
    folder.chmod(0o755)
    lock = folder / "start.lock"
    lock.write_text("")
    lock.chmod(0o444)
    holder = lock.open("r")
    fcntl.flock(holder, fcntl.LOCK_EX)
    pid = os.fork()  # the check in a child that is not root (root writes anything), as the unit runs
    if pid == 0:
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            os._exit(0 if lock_held(lock) else 1)
        finally:
            os._exit(2)
    holder.close()
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(folder)
    assert os.waitstatus_to_exitcode(status) == 0, "the watchdog did not see the held start lock"


def test_ssh_to_the_service_user_uses_its_key(tmp_path):
    from dsv41.ops.host_commands import remote_argv, service_identity

    (tmp_path / "id_ed25519").write_text("key")
    (tmp_path / "known_hosts").write_text("spark-b ssh-ed25519 AAAA\n")
    assert service_identity("dsv41@spark-b", tmp_path) == [
        "-i", str(tmp_path / "id_ed25519"), "-o", "IdentitiesOnly=yes",
        "-o", f"UserKnownHostsFile={tmp_path / 'known_hosts'}"]
    assert service_identity("root@spark-b", tmp_path) == []  # the operator's own ssh setup
    assert service_identity("dsv41@spark-b", tmp_path / "missing") == []
    assert remote_argv(["true"], "root@spark-b")[-3:] == ["root@spark-b", "--", "true"]
