"""The cgroup cpuset of this process from fabricated cgroupfs trees (v2, v1, namespaced)."""

from __future__ import annotations

from fake_sysfs import Machine, write_cgroup_v2, write_machine

from cpud.placement.cgroup import CgroupCpuset, cgroup_membership, read_cpuset


def tree(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, Machine(cores_per_node=8))
    return sys_root, proc_root, sys_root / "fs" / "cgroup"


def write_v1_cpuset(cgroup_root, proc_root, path: str, files: dict[str, str]) -> None:
    level = cgroup_root / "cpuset" / path.lstrip("/")
    level.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (level / name).write_text(text + "\n")
    (proc_root / "self" / "cgroup").write_text(f"4:memory:/\n3:cpuset,cpu:{path}\n0::/\n")


def test_membership_lists_v2_and_every_v1_controller(tmp_path):
    _, proc_root, _ = tree(tmp_path)
    (proc_root / "self" / "cgroup").write_text(
        "4:memory:/m\n3:cpu,cpuacct:/c\n1:name=systemd:/s\n0::/u\n"
    )
    v2, v1 = cgroup_membership(proc_root)
    assert v2 == "/u"
    assert v1 == {"memory": "/m", "cpu": "/c", "cpuacct": "/c", "name=systemd": "/s"}
    assert cgroup_membership(tmp_path / "no-proc") == (None, {})


def test_v2_leaf_cpuset(tmp_path):
    sys_root, proc_root, root = tree(tmp_path)
    write_cgroup_v2(
        sys_root,
        proc_root,
        "/svc",
        {
            "/": {"cpuset.cpus.effective": "0-7"},
            "/svc": {"cpuset.cpus.effective": "2-5", "cpuset.mems.effective": "0"},
        },
    )
    assert read_cpuset(root, proc_root) == CgroupCpuset(2, "/svc", (2, 3, 4, 5), (0,))


def test_v2_cgroup_without_cpuset_controller_inherits_the_nearest_ancestor(tmp_path):
    sys_root, proc_root, root = tree(tmp_path)
    write_cgroup_v2(
        sys_root,
        proc_root,
        "/a/b/c",
        {
            "/": {"cpuset.cpus.effective": "0-7"},
            "/a": {"cpuset.cpus.effective": "4-7"},
            "/a/b/c": {"memory.max": "max"},
        },
    )
    cpuset = read_cpuset(root, proc_root)
    assert cpuset is not None and cpuset.cpus == (4, 5, 6, 7) and cpuset.path == "/a/b/c"
    assert cpuset.mems is None


def test_v1_cpuset_and_namespaced_mount(tmp_path):
    _, proc_root, root = tree(tmp_path)
    write_v1_cpuset(root, proc_root, "/docker/abc", {"cpuset.effective_cpus": "1,3"})
    (root / "cpuset" / "cpuset.effective_cpus").write_text("0-7\n")
    assert read_cpuset(root, proc_root) == CgroupCpuset(1, "/docker/abc", (1, 3), None)
    # Inside a cgroup namespace /proc/self/cgroup names a path the mount does not have.
    (proc_root / "self" / "cgroup").write_text("3:cpuset:/elsewhere\n")
    assert read_cpuset(root, proc_root).cpus == tuple(range(8))


def test_no_cpuset_anywhere(tmp_path):
    sys_root, proc_root, root = tree(tmp_path)
    write_cgroup_v2(sys_root, proc_root, "/svc", {"/svc": {"memory.max": "max"}})
    assert read_cpuset(root, proc_root) is None
