package main

import (
	"context"
	"fmt"
	"runtime"
	"runtime/debug"
)

// version is the release version, set at build time with
// -ldflags "-X main.version=v1.2.3".
var version = "dev"

func init() {
	register(command{name: "version", summary: "Print the eventline version", run: runVersion})
}

func runVersion(ctx context.Context, args []string) error {
	fs := newFlagSet(ctx, "version", "", "Prints the CLI's version, the eventline module version and the Go version it was built with.")
	pos, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fs.usageErrorf("version takes no arguments, got %q", pos)
	}
	fmt.Fprintln(stdout(ctx), versionString())
	return nil
}

// versionString describes this build: "eventline dev (module (devel), go1.26.0, commit abc123)".
func versionString() string {
	s := "eventline " + version
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return s + " (" + runtime.Version() + ")"
	}
	s += " (module " + info.Main.Version + ", " + runtime.Version()
	var rev, dirty string
	for _, kv := range info.Settings {
		switch kv.Key {
		case "vcs.revision":
			rev = kv.Value
		case "vcs.modified":
			if kv.Value == "true" {
				dirty = ", modified"
			}
		}
	}
	if rev != "" {
		s += ", commit " + rev[:min(12, len(rev))] + dirty
	}
	return s + ")"
}
