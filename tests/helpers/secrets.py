"""Files as Kubernetes keeps a Secret's in a pod, renewed in place as it renews them."""

from __future__ import annotations

from pathlib import Path


class SecretVolume:
    """TLS files as a Kubernetes Secret's volume holds them, renewed as the kubelet renews
    them: each file a symlink through ``..data``, which is swapped whole (one rename) to a
    new folder of the files."""

    def __init__(self, folder: Path, files: dict[str, Path]) -> None:
        self.folder = folder
        folder.mkdir()
        self.versions = 0
        self.write({name: source.read_bytes() for name, source in files.items()})
        for name in files:
            (folder / name).symlink_to(Path("..data") / name)

    def __getitem__(self, name: str) -> str:
        return str(self.folder / name)

    def write(self, contents: dict[str, bytes]) -> None:
        self.versions += 1
        version = self.folder / f"..{self.versions}"
        version.mkdir()
        for name, data in contents.items():
            (version / name).write_bytes(data)
        (self.folder / "..data_tmp").symlink_to(version.name)
        (self.folder / "..data_tmp").replace(self.folder / "..data")

    def renew(self, files: dict[str, Path]) -> None:
        self.write({name: source.read_bytes() for name, source in files.items()})
