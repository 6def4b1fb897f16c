"""Online control inside a running job: the controller and its decision types, the response-length
forecast, online calibration, the plan cache, the audit log and framework metric adapters.
See README.md."""
