"""What a fit checks in the launching process, before any rank starts: :mod:`.checks` (the options against the
model, data and devices), :mod:`.preflight` (the user's data, model and loss, tried on a sample) and
:mod:`.tp_check` (a tensor-parallel plan applied to a meta copy)."""
