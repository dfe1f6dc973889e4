"""The fp32 reference speculator's attention: an oracle that shares no code with
``backends/`` (it imports only ``contract``), so the shipped ``reference`` backend is
checked against it too (``vs_fp32_reference`` runs for every backend).

Owns: each call's requests and their tokens' positions, from the batch's host offsets and
lengths (:mod:`.spans`); the KV write into slots it computes itself from those positions and
the block table (:mod:`.kv_write`); dense attention over each request's keys and values
gathered into one contiguous tensor, a plain masked softmax in fp64 (:mod:`.attention`),
requests of similar length batched together (:mod:`.chunks`);
and the builder and impl the harness installs for the reference speculator's ``reference``
layers (:mod:`.builder`).
"""
