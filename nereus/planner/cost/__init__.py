"""The analytic cost model: time and memory of one model-stage under one parallel config
(``model.estimate``), its coefficients (``params.CostParams``), the response-length distribution
(``lengths``) and the step time of a whole plan (``plan_times``). See README.md."""
