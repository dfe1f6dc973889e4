"""speccheck: declare, gate and verify fused multi-step draft decoding of attention backends.

Layers, with dependencies pointing one way: ``contract`` <- ``backends`` <- ``speculator``
<- ``checks``. ``matrix.yaml`` (shipped inside the package) is the single source of truth
for what each backend may do.
"""

__version__ = "0.1.0"
