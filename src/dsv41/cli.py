def main(argv=None):
    raise SystemExit("dsv41: cli not yet built")
