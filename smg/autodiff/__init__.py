"""The backward of a forward SMG, derived by differentiating its index expressions (``derive_backward``).

One concern per module: ``local`` (an op's local derivatives, sympy), ``stabiliser`` (which max has a zero
adjoint), ``sweep`` (the reverse sweep and the duals of the mappings), ``rewrite`` (saved statistics, their
compression, postposition, reassociation), ``backward`` (the orchestration and the backward SMG).  The cut
of the backward into kernels is a scheduling decision: ``schedulers.passes``.
"""

from smg.autodiff.backward import Backward, derive_backward

__all__ = ["Backward", "derive_backward"]
