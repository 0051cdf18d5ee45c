"""The torch optimizers and their bucket machinery (re-exported by :mod:`slamb_comm.adapters.torch`).

=====================  =========================================================================
module                 what it holds
=====================  =========================================================================
``bucket``             :class:`~.bucket.Bucket`: parameters that share one Communicator and one core rule
``flat``               :class:`~.flat.FlatBuffer`: a bucket's parameters as one flat buffer (``fused=``)
``slamb_options``      SLAMB's options: a group's checks, the records its buckets are keyed by
``slamb``              :class:`SLAMB`, :class:`SAdamW`, :class:`LAMB`
``onebit_lamb``        :class:`OneBitLAMB`
``base``               :class:`~.base.BucketedOptimizer`: buckets, their state, steps, skips and traffic, once
``ledger``             :class:`~.ledger.StepLedger`: skipped steps and traffic, as every optimizer keeps them
``slamb_state``        SLAMB's torch state, bucket by bucket
``demo``               :class:`DeMo`
=====================  =========================================================================
"""
