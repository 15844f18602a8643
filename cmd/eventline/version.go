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

// libraryModule is the module the command is built against: its own
// module (cmd/eventline) requires it.
const libraryModule = "github.com/eventline/eventline"

func runVersion(_ context.Context, inv *invocation) error {
	if _, err := inv.parse(); err != nil {
		return err
	}
	fmt.Fprintln(inv.stdout, versionString())
	return nil
}

// versionString describes this build: "eventline dev (library
// github.com/eventline/eventline v1.2.3, go1.26.0, commit abc123)".
func versionString() string {
	s := "eventline " + version
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return s + " (" + runtime.Version() + ")"
	}
	s += " (library " + libraryModule + " " + libraryVersion(info) + ", " + runtime.Version()
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

// libraryVersion is the version of the library module this build linked:
// the required version, or, when go.mod replaces it (as in the repository,
// with the library in ../..), what replaced it.
func libraryVersion(info *debug.BuildInfo) string {
	if info.Main.Path == libraryModule {
		return info.Main.Version
	}
	for _, dep := range info.Deps {
		if dep.Path != libraryModule {
			continue
		}
		switch {
		case dep.Replace == nil:
			return dep.Version
		case dep.Replace.Version == "" || dep.Replace.Version == "(devel)":
			return "(devel, replaced by " + dep.Replace.Path + ")"
		default:
			return dep.Replace.Version + " (replaced by " + dep.Replace.Path + ")"
		}
	}
	return "(unknown)"
}
