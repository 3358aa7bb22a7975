"""The writing side's commit machinery: commit policies, group commit and intents (the
journal of log versions they commit through is ``batchweave.journal``)."""
