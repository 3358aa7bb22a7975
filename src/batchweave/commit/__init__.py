"""The writing side's commit machinery: the journal of log versions, commit policies, group commit and intents."""
