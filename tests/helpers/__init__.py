"""Code the tests of several folders share: tiny models and the engines they train in (:mod:`.models`)."""
