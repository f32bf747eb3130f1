"""spacefusion: operator fusion via Space-Mapping Graphs, lowered through Apache TVM.

Import-light on purpose: the GPU runtime (``spacefusion.runtime``) must load
on a machine without TVM, islpy or xgboost, so nothing heavy is imported here.
"""

__version__ = "0.2.0"


def __getattr__(name: str):
    if name in ("build", "schedule", "evaluate", "interpret", "random_inputs", "traffic"):
        from spacefusion import api

        return getattr(api, name)
    if name in ("compile", "report"):  # torch.compile with the spacefusion backend (frontend.dynamo); its reports
        from spacefusion.frontend import dynamo

        return getattr(dynamo, name)
    if name == "workloads":
        import smg.workloads

        return smg.workloads
    raise AttributeError(name)
