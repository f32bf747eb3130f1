"""Everything TVM-specific lives in this package (nothing else imports tvm)."""
