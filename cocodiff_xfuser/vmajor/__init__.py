"""V-Major: over slow links, send only the tokens whose V changed since the receivers last got them.

Per attention layer and token, the sender compares this step's V with its *reference*, the value
it last sent for that token (so a token that stays cached for many steps never drifts further
than the policy allows). Tokens the policy selects are *active*: the exchange sends them to every
rank, and the others only to node-mates (:mod:`cocodiff_xfuser.comm.sparse`); receivers on other nodes keep the
previous result of the exchange and update its active rows. With scope ``qkv`` the Q and K
exchanges of the layer follow V's selection (the paper's reading); with scope ``v`` they are exact;
with ``qkvo`` the output exchange follows it too: a rank's output rows are its own tokens, so each
sender sends a rank on another node its attention output at that rank's active tokens, whose
indices it received with V's rows (nothing more travels), and keeps its own reference. Where Q
and K follow, a sparse step's V rows ride in Q/K's exchange (:attr:`.policy.Step.v_rides`).

Decisions that change which collectives run (full or sparse exchange at this step, whether a
layer fits the cache budget, how many rows each rank sends) depend only on the step, the shapes,
the settings and agreed values, which every rank shares; the selected rows are rank-local and
travel, after a bitmask of them, in the exchange. Every policy fixes each rank's count on the host
before the layer runs, so a layer's exchange needs no agreement and no host synchronization:
``top-k`` and ``schedule`` from the settings and the step, ``budget`` and ``threshold`` from the
shares their layers measured at earlier steps, agreed once per step. Tokens are ranked by integer
sums, as a stable sort orders them (:func:`.policy.decide`; Triton kernels on a GPU, the torch
reference on CPU): the same tokens on every device.

``budget`` (what ``--cocodiff-v-major auto`` runs) sends, per layer, the fewest tokens that keep the
relative L2 error of V as the receivers hold it within ``error``: every layer measures at every
step, on the device, how many of its tokens that took (the senders know exactly what the
receivers hold), and the clock agrees the counts once per step (one all-reduce, MAX over the
group, that no rank waits for: it is read a step later, so a step sends the counts measured two
steps before, the first sparse step those of the step before). ``auto`` maps a PSNR target to ``error`` with a calibration measured on
the trained models (``configs/policies/v-major-calibration.yaml``), and turns V-Major off where
its steps are not faster than exact ones (:class:`.clock.Trial`; ``if_slower: keep`` keeps it on, e.g. to
save the bytes of a metered link).

Caches live per attention layer and per transformer call within a step (true CFG calls the
transformer twice per step) and are dropped when a new pipeline call starts, which a
transformer's clock sees as a timestep that does not decrease.

Under Ulysses inside the node x Ring across nodes the exchange that crosses the slow links is the
ring attention's K/V: V-Major runs on it the same way (:mod:`.ring`).

The package: :mod:`.policy` (each layer call's decision and the rows each covered exchange sends),
:mod:`.clock` (the step of a transformer, the counts agreed once per step, auto's speed check),
:mod:`.state` (caches and their budget) and :mod:`.ring` (the ring's K/V); the knobs are :class:`cocodiff_xfuser.settings.VMajorSettings`,
and rows travel as step residuals through :mod:`cocodiff_xfuser.comm.residuals`, which any exchange
that repeats per step can use. This ``__init__`` imports nothing, so its modules import no cycle.
"""
