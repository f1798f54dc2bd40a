"""Analysis of runs and recipes: the plan (``fedfusion plan``), the report, edge vs cloud, the seed paper's setting."""
