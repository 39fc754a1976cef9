"""Which file system a local path lives on: local disks and network file systems differ in
where reading them is cheapest."""

from __future__ import annotations

import os

NETWORK_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "9p", "afs", "panfs", "wekafs", "orangefs", "ocfs2", "davfs",
})


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the file system holding ``path`` (``"ext4"``, ``"nfs4"``, ``"fuse.s3fs"``),
    from /proc/self/mounts; ``None`` where that cannot be told."""
    try:
        target = os.path.realpath(path)
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    best, best_type = "", None
    for point, fstype in mounts:
        point = _unescape(point)
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, fstype
    return best_type


def is_network(path: str | os.PathLike) -> bool:
    """Whether reads of ``path`` cross a network (NFS, SMB, Lustre, a FUSE-mounted bucket...)."""
    fstype = filesystem_type(path)
    if fstype is None:
        return False
    return fstype in NETWORK_TYPES or (fstype.startswith("fuse.") and fstype != "fuse.lxcfs")
