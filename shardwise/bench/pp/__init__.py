"""The pipeline pairs of ``shardwise bench``: our 1F1B and interleaved schedules against torch's pipelining
(``mp.py``), ZB-H1 (``zb.py``), and the V schedules ZBV and DualPipeV (``zbv.py``)."""
