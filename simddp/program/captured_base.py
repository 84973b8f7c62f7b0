"""What every capture shares: JSON round trips with its kind and schema version, the network it
ran on, and (:class:`MeshCapture`) a DeviceMesh's dimensions. The captures themselves:
:mod:`simddp.program.captured` (all of them, and reading one back from a file)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from ..models import Network

__all__ = ["JSONRecord", "CaptureRecord", "MeshCapture", "SCHEMA_VERSION"]

# the saved form's version: a file names its kind (the captured class) and this; files
# without them (written before) are read as version 1 and their kind told from their fields
SCHEMA_VERSION = 1


class JSONRecord:
    """JSON round trips for a capture dataclass (its ``from_dict`` rebuilds nested parts): ``to_dict`` names the kind (the class) and
    :data:`SCHEMA_VERSION`."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "schema": SCHEMA_VERSION,
                **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    save = to_json

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> Any:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Any:
        with open(path) as f:
            return cls.from_json(f.read())


class CaptureRecord(JSONRecord):
    """What every capture answers besides its data."""

    network: dict[str, Any] | None

    def network_model(self) -> Network | None:
        """The capture's network (None if it was not a :class:`Network`)."""
        return None if self.network is None else Network(**self.network)


class MeshCapture(CaptureRecord):
    """A capture on a DeviceMesh (``mesh``: dimension → size)."""

    mesh: dict[str, int]

    @property
    def shard_size(self) -> int:
        return int(self.mesh.get("shard", 1))

    @property
    def tp_size(self) -> int:
        return int(self.mesh.get("tp", 1))
