"""The health stage: the one owner of every pool member's health, and the hand-off of its changes."""
