"""The final persist: however training ended, the last step ends up in one complete checkpoint.

Written from the live tensors, every unit whole. A partial persist of the same step is superseded (written apart,
then replaced in the manifest); a complete one that already holds the live state, by the digests every rank
records of it, is left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moc_lightning.engine.completeness import state_digest
from moc_lightning.engine.units import ExpertUnit
from moc_lightning.memory.encoding import encode_state
from moc_lightning.pec.checkpointer import PECCheckpointer
from moc_lightning.pec.persist import SaveReport
from moc_lightning.runtime.agreement import from_coordinator, gather
from moc_lightning.runtime.faults import FaultInjector


def persist_final(
    pec: PECCheckpointer, faults: FaultInjector, step: int, trainer_state: Mapping[str, Any] | None
) -> SaveReport | None:
    """Persist every unit at ``step`` from the live tensors (collective); see
    :meth:`~moc_lightning.memory.two_level.TwoLevelCheckpointer.persist_final`. Returns ``None`` when nothing
    needed writing."""
    experts = tuple(ExpertUnit(layer, e) for layer, n in enumerate(pec.layout.num_experts) for e in range(n))
    units = pec.layout.dense_units + experts
    newest = from_coordinator(lambda: pec.read_manifest().latest)
    if newest is not None and newest.step > step:
        return None
    digests = tuple(gather(state_digest(pec.layout.pieces(pec.layout.units)), pec.process_group))
    supersede = newest is not None and newest.step == step
    if newest is not None and supersede and all(newest.holds(u.key) for u in units):
        if newest.digests == digests:
            return None
        if pec.topology.rank == 0:
            print(f"[moc_lightning] the complete checkpoint of step {step} ({newest.name}) does not hold the live "
                  f"state ({'its digests differ' if newest.digests else 'it records no digest'}); persisting it "
                  "again from the live state")
    pec.tokens.mark_step(step)
    return pec.persist(
        step, units, trainer_state=encode_state(trainer_state), supersede=supersede, digests=digests,
        before_commit=lambda: faults.at("final_persist", step),
    )
