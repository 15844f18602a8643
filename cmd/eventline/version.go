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

func runVersion(_ context.Context, inv *invocation) error {
	if _, err := inv.parse(); err != nil {
		return err
	}
	fmt.Fprintln(inv.stdout, versionString())
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
