"""KV-cache sizing (``kvgate calc``): arithmetic over a model's ``config.json`` in :mod:`sizing.calc`, the
command around it in :mod:`sizing.cli`. Not part of the gateway: nothing here is imported while serving."""
