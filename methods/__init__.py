"""FL methods, one module each. See README.md in this folder for the contract."""
