"""Shared test support: the float64 reference, the direct cache model, tolerance helpers
and the AddressSanitizer child runner. Test modules import from here, never from each other."""
