"""The cost model against published GPU measurements: the corpus (``nereus/calibration/published``),
what each row means to the model (``catalog``), its prediction (``predict``), profiles fitted on
the fit split (``fit``) and the report (``report``) behind ``nereus fidelity``. Torch-free."""
