"""A learned cost model: XGBoost ranking over schedule features, retrained as records arrive.

Why ranking: the tuner only needs to order the candidates of one workload,
and latencies of different workloads span orders of magnitude, so a
regression on absolute time would spend its capacity on between-workload
differences.  A pairwise ranking objective with one query group per workload
learns only within-workload orderings.

Labels: ``-log(median_us)`` (higher is better) for ``rank:pairwise``, which
compares labels only within a group, so continuous values are fine and no
binning into integer relevance (as ``rank:ndcg`` would need) is required.  A
failed record gets its group's worst label minus one, so it ranks below every
candidate that ran.

Predictions are costs, LOWER is better (the negated ranker margin).  They are
comparable among candidates of one workload only: the ranker's scale carries
no meaning across groups.

Persistence is xgboost's own JSON model plus a JSON sidecar (format, feature
names, hardware, parameters); never pickle.  The training records themselves
are not saved: after ``load``, ``update`` trains on the records given from then
on, so a tuner that restarts should ``fit`` on its database.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xgboost as xgb

from schedulers.hardware import HardwareModel
from schedulers.schedule import Schedule
from search.features import FEATURE_NAMES, feature_matrix
from search.metrics import spearman, top1_slowdown, top_k_recall
from search.records import MeasureResult

MODEL_FORMAT = "spacefusion-cost-model/1"

Schedules = Sequence[Schedule] | np.ndarray


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".json") + ".meta.json")


def _check_names(names: Sequence[str], where: str) -> None:
    """Raise ValueError naming how ``names`` differ from this code's FEATURE_NAMES."""
    names = tuple(names)
    if names == FEATURE_NAMES:
        return
    missing = [n for n in FEATURE_NAMES if n not in names]
    extra = [n for n in names if n not in FEATURE_NAMES]
    parts = []
    if missing:
        parts.append(f"missing {missing}")
    if extra:
        parts.append(f"unknown {extra}")
    if not parts:
        first = next(i for i, (a, b) in enumerate(zip(names, FEATURE_NAMES)) if a != b)
        parts.append(f"same names in another order (first difference at {first}: "
                     f"{names[first]!r} vs {FEATURE_NAMES[first]!r})")
    raise ValueError(f"{where}: feature names differ from this version's FEATURE_NAMES: {'; '.join(parts)}")


def _in_this_layout(path: Path, sidecar_names: Sequence[str], where: str) -> bytearray:
    """The xgboost JSON at ``path`` with its split indices moved to this version's FEATURE_NAMES.

    A model saved before a feature was added (a knob's new column) or the columns were reordered is the
    same function of the features it knew: each split is re-pointed at its feature's new position, and a
    new column is one the model never splits on.  A model that needs a feature this code no longer
    computes is refused (ValueError naming it), as is a sidecar that disagrees with its model."""
    model = json.loads(path.read_text())
    learner = model["learner"]
    names = tuple(learner.get("feature_names") or ())
    for given in (tuple(sidecar_names), names):
        if any(n not in FEATURE_NAMES for n in given) or len(set(given)) != len(given):
            _check_names(given, where)
    if tuple(sidecar_names) != names:
        raise ValueError(f"{where}: the sidecar's feature names are not those of {path.name}")
    if names != FEATURE_NAMES:
        at = [FEATURE_NAMES.index(n) for n in names]
        for tree in learner["gradient_booster"]["model"]["trees"]:
            tree["split_indices"] = [at[i] for i in tree["split_indices"]]
            tree["tree_param"]["num_feature"] = str(len(FEATURE_NAMES))
        learner["learner_model_param"]["num_feature"] = str(len(FEATURE_NAMES))
        learner["feature_names"] = list(FEATURE_NAMES)
        if learner.get("feature_types"):
            learner["feature_types"] = ["float"] * len(FEATURE_NAMES)
    return bytearray(json.dumps(model).encode())


def relevance(medians_us: np.ndarray, qid: np.ndarray) -> np.ndarray:
    """Ranking labels: ``-log(median_us)``; failures (inf) get their group's worst label minus one."""
    med = np.asarray(medians_us, dtype=np.float64)
    ok = np.isfinite(med) & (med > 0)
    y = np.zeros(med.size, dtype=np.float64)
    y[ok] = -np.log(med[ok])
    for g in np.unique(qid):
        sel = qid == g
        good = sel & ok
        worst = y[good].min() - 1.0 if good.any() else 0.0
        y[sel & ~ok] = worst
    return y


class LearnedCostModel:
    """Gradient-boosted pairwise ranker over ``search.features``; lower predicted cost is better.

    Small and seeded (``seed``, ``nthread``) so that training is deterministic
    and takes well under a second on a few hundred records.
    """

    def __init__(self, hw: HardwareModel, *, num_rounds: int = 150, max_depth: int = 6,
                 learning_rate: float = 0.1, num_pairs_per_sample: int = 8, seed: int = 0,
                 nthread: int = 1) -> None:
        self.hw = hw  # the machine whose numbers the features are computed with: no default, it is a choice
        self.meta: dict[str, Any] = {}  # a loaded model's sidecar (what it was trained on)
        self.num_rounds = int(num_rounds)
        self.params: dict[str, Any] = {
            "objective": "rank:pairwise",
            # sample pairs uniformly within a group: every ordering counts, not only the top
            "lambdarank_pair_method": "mean",
            "lambdarank_num_pair_per_sample": int(num_pairs_per_sample),
            "eta": float(learning_rate),
            "max_depth": int(max_depth),
            "min_child_weight": 0.0,  # pairwise hessians are tiny; the default 1 would stop every split
            "tree_method": "exact",
            "seed": int(seed),
            "nthread": int(nthread),
            "verbosity": 0,
        }
        self._booster: xgb.Booster | None = None
        self._reset()

    def _reset(self) -> None:
        self._X = np.zeros((0, len(FEATURE_NAMES)), dtype=np.float64)
        self._med = np.zeros(0, dtype=np.float64)
        self._groups: list[Hashable] = []
        self._seen: set[str] = set()

    # -- data ---------------------------------------------------------------------------------
    def _matrix(self, schedules: Schedules) -> np.ndarray:
        if isinstance(schedules, np.ndarray):
            X = np.asarray(schedules, dtype=np.float64)
            if X.ndim != 2 or X.shape[1] != len(FEATURE_NAMES):
                raise ValueError(f"feature matrix must have shape (n, {len(FEATURE_NAMES)}), got {X.shape}")
            return X
        return feature_matrix(schedules, self.hw)

    def _records(self, schedules: Schedules, results: Sequence[MeasureResult],
                 groups: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, list[Hashable]]:
        n = len(schedules)
        if len(results) != n or len(groups) != n:
            raise ValueError(f"need one result and one group per schedule, got {n} schedules, "
                             f"{len(results)} results, {len(groups)} groups")
        if not isinstance(schedules, np.ndarray):
            for s, r in zip(schedules, results):
                if r.schedule_key != s.key:
                    raise ValueError(f"result for {r.schedule_key[:12]} paired with schedule {s.key[:12]}: "
                                     f"records are misaligned")
        X = self._matrix(schedules)
        med = np.array([r.median_us if r.ok else math.inf for r in results], dtype=np.float64)
        return X, med, list(groups)

    def _add(self, schedules: Schedules, results: Sequence[MeasureResult], groups: Sequence[Hashable]) -> None:
        X, med, g = self._records(schedules, results, groups)
        self._X = np.vstack([self._X, X])
        self._med = np.concatenate([self._med, med])
        self._groups += g
        if not isinstance(schedules, np.ndarray):
            self._seen.update(s.key for s in schedules)

    def _train(self) -> None:
        if not self._groups:
            raise ValueError("no records to train on")
        ids: dict[Hashable, int] = {}
        qid = np.array([ids.setdefault(g, len(ids)) for g in self._groups], dtype=np.int64)
        order = np.argsort(qid, kind="stable")  # xgboost needs each query group contiguous
        y = relevance(self._med, qid)
        dm = xgb.DMatrix(self._X[order], label=y[order], qid=qid[order], feature_names=list(FEATURE_NAMES))
        self._booster = xgb.train(self.params, dm, num_boost_round=self.num_rounds)

    # -- public -------------------------------------------------------------------------------
    @property
    def is_trained(self) -> bool:
        return self._booster is not None

    @property
    def num_records(self) -> int:
        """Records the current model was (or will be, on the next update) trained on."""
        return len(self._groups)

    def fit(self, schedules: Schedules, results: Sequence[MeasureResult], groups: Sequence[Hashable]) -> None:
        """Forget earlier records and train on these; ``groups[i]`` names the workload of record i
        (e.g. its SMG key), the unit within which candidates are ranked."""
        self._reset()
        self._add(schedules, results, groups)
        self._train()

    def update(self, schedules: Schedules, results: Sequence[MeasureResult], groups: Sequence[Hashable]) -> None:
        """Add records and retrain from scratch on all seen so far (a few hundred records: cheap,
        and unlike continued boosting it does not depend on the order records came in)."""
        self._add(schedules, results, groups)
        self._train()

    def predict(self, schedules_or_features: Schedules) -> np.ndarray:
        """Predicted costs, lower is better, comparable within one workload."""
        if self._booster is None:
            raise RuntimeError("the cost model is not trained; call fit() first")
        X = self._matrix(schedules_or_features)
        if X.shape[0] == 0:
            return np.zeros(0, dtype=np.float64)
        dm = xgb.DMatrix(X, feature_names=list(FEATURE_NAMES))
        return -self._booster.predict(dm, output_margin=True).astype(np.float64)

    def evaluate(self, schedules: Schedules, results: Sequence[MeasureResult], groups: Sequence[Hashable],
                 k: int = 5) -> dict[str, Any]:
        """Per-group and mean Spearman (predicted cost vs measured median_us), top-1 slowdown and
        top-``k`` recall.  Meant for held-out records; ``num_seen`` counts those already trained on.

        Groups of fewer than two records have no ranking and are left out of the means.
        """
        X, med, g = self._records(schedules, results, groups)
        pred = self.predict(X)
        per: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(g):
            sel = np.array([x == name for x in g])
            if sel.sum() < 2:
                per[str(name)] = {"n": int(sel.sum()), "spearman": None, "top1_slowdown": None,
                                  f"top{k}_recall": None}
                continue
            per[str(name)] = {
                "n": int(sel.sum()),
                "spearman": spearman(pred[sel], med[sel]),
                "top1_slowdown": top1_slowdown(pred[sel], med[sel]),
                f"top{k}_recall": top_k_recall(pred[sel], med[sel], k),
            }
        ranked = [v for v in per.values() if v["spearman"] is not None]

        def mean(key: str) -> float:
            xs = [v[key] for v in ranked if v[key] is not None and not math.isnan(v[key])]
            return float(np.mean(xs)) if xs else float("nan")

        seen = 0 if isinstance(schedules, np.ndarray) else sum(s.key in self._seen for s in schedules)
        return {
            "groups": per,
            "mean_spearman": mean("spearman"),
            "mean_top1_slowdown": mean("top1_slowdown"),
            f"mean_top{k}_recall": mean(f"top{k}_recall"),
            "num_records": len(g),
            "num_seen": int(seen),
        }

    # -- persistence --------------------------------------------------------------------------
    def save(self, path: str | Path, training: dict[str, Any] | None = None) -> None:
        """Write the booster as xgboost JSON at ``path`` (must end in .json) and a ``.meta.json`` sidecar;
        ``training`` (what it was trained on, how it did held out) goes into the sidecar as it is."""
        if self._booster is None:
            raise RuntimeError("nothing to save: the cost model is not trained")
        path = Path(path)
        if path.suffix != ".json":
            raise ValueError(f"model path must end in .json (xgboost picks its format by suffix), got {path}")
        self._booster.save_model(str(path))
        meta = {
            "format": MODEL_FORMAT,
            "feature_names": list(FEATURE_NAMES),
            "hardware": self.hw.to_dict(),
            "params": self.params,
            "num_rounds": self.num_rounds,
            "num_records": self.num_records,
            "xgboost_version": xgb.__version__,
        }
        if training is not None:
            meta["training"] = training
        _sidecar(path).write_text(json.dumps(meta, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> LearnedCostModel:
        """Read a model written by ``save``; ValueError if its features are not this version's."""
        path = Path(path)
        side = _sidecar(path)
        try:
            meta = json.loads(side.read_text())
        except FileNotFoundError:
            raise ValueError(f"no sidecar {side} next to {path}: not a spacefusion cost model") from None
        if not isinstance(meta, dict) or meta.get("format") != MODEL_FORMAT:
            raise ValueError(f"{side} is not a spacefusion cost-model sidecar (format "
                             f"{meta.get('format') if isinstance(meta, dict) else None!r})")
        booster = xgb.Booster()
        booster.load_model(_in_this_layout(path, meta.get("feature_names", ()), str(side)))
        _check_names(booster.feature_names or (), str(path))
        model = cls(HardwareModel.from_dict(meta["hardware"]), num_rounds=int(meta["num_rounds"]))
        model.params = dict(meta["params"])
        model._booster = booster
        model.meta = meta
        return model
