"""The writing side's commit machinery: commit policies, group commit and intents, and
the loops that commit a producer's TGBs (``loop``; ``turns`` for group commit) over the
state they share with it (``shared``). The journal of log versions they commit through
is ``batchweave.journal``."""
