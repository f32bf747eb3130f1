"""SMG <-> plain JSON data (for schedules and tuning records)."""

from __future__ import annotations

from typing import Any

from smg.hashing import canonical
from smg.ir import SMG, Access, DataSpace, Dim, Op


def smg_to_dict(smg: SMG) -> dict[str, Any]:
    return canonical(smg)


def smg_from_dict(d: dict[str, Any]) -> SMG:
    return SMG(
        name=d["name"],
        dims=tuple(Dim(x["name"], int(x["size"])) for x in d["dims"]),
        spaces=tuple(DataSpace(x["name"], tuple(x["dims"]), x["dtype"]) for x in d["spaces"]),
        ops=tuple(
            Op(o["kind"], o["out"], tuple(o["out_index"]),
               tuple(Access(a["space"], tuple(a["index"])) for a in o["inputs"]),
               o["body"], tuple(o["reduce"]), o["combiner"], o.get("group", ""))
            for o in d["ops"]
        ),
        outputs=tuple(d["outputs"]),
        attrs=tuple(tuple(a) for a in d.get("attrs", ())),
    )
