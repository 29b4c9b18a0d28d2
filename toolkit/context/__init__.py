"""Context parallelism: ring attention over a CP group (``ring_attention``), the dynamic CP scheduler that picks a CP
size per sequence (``dynamic_cp``) and a cost model of both at scale (``dcp_sim``). Import the modules by name."""
