"""The workshop on top of the library, which never imports it: the cost model (``cost``), the
hardware caveat catalog (``catalog``), environment detection (``environment``), the TPU
recipe (``tpu``), figures and tables, the bytes of ring programs (``accounting``), the checks
against published numbers (``validation``), bench, doctor, the self-test and the command line
(``python -m xla_permute_tools``)."""
