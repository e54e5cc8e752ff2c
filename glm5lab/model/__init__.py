"""The tiny GLM-5-shaped model every notebook and test runs on (real attention geometry, small rest)."""
