package kafkabroker

import (
	"bytes"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// probeSource is java/PartitionProbe.java: it produces keyed records with
// Apache Kafka's Java producer and default partitioner.
//
//go:embed java/PartitionProbe.java
var probeSource []byte

// Placement is where the Java producer's record for a key landed.
type Placement struct {
	Partition int32
	Offset    int64
}

// RunPartitionProbe produces one record per key to topic on brokers with
// Kafka's Java producer (kafka-clients from the same jars as the broker,
// default partitioner), and returns where the broker put each key's
// record. The probe is compiled with javac on first use and cached.
func RunPartitionProbe(ctx context.Context, brokers []string, topic string, keys []string) (map[string]Placement, error) {
	jars, err := Jars(ctx)
	if err != nil {
		return nil, err
	}
	classes, err := compileProbe(ctx, jars)
	if err != nil {
		return nil, err
	}
	java, err := javaPath()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
		"-cp", filepath.Join(jars, "*")+string(os.PathListSeparator)+classes,
		"PartitionProbe", strings.Join(brokers, ","), topic)
	cmd.Stdin = strings.NewReader(strings.Join(keys, "\n") + "\n")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("kafkabroker: run PartitionProbe: %w\n%s", err, tail(stderr.Bytes(), 30))
	}
	out := make(map[string]Placement, len(keys))
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 3 {
			return nil, fmt.Errorf("kafkabroker: PartitionProbe printed %q, want key, partition, offset", line)
		}
		p, err1 := strconv.ParseInt(f[1], 10, 32)
		o, err2 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("kafkabroker: PartitionProbe printed %q", line)
		}
		out[f[0]] = Placement{Partition: int32(p), Offset: o}
	}
	if len(out) != len(keys) {
		return nil, fmt.Errorf("kafkabroker: PartitionProbe reported %d keys of %d", len(out), len(keys))
	}
	return out, nil
}

// compileProbe compiles the probe into the cache, once per source and jar
// set, and returns the classes directory.
func compileProbe(ctx context.Context, jars string) (string, error) {
	sum := sha256.Sum256(append(append([]byte{}, probeSource...), pom...))
	classes := filepath.Join(filepath.Dir(jars), "probe-"+hex.EncodeToString(sum[:8]))
	if _, err := os.Stat(filepath.Join(classes, "PartitionProbe.class")); err == nil {
		return classes, nil
	}
	javac, err := exec.LookPath("javac")
	if home := os.Getenv("JAVA_HOME"); home != "" {
		if p := filepath.Join(home, "bin", "javac"); fileExists(p) {
			javac, err = p, nil
		}
	}
	if err != nil {
		return "", fmt.Errorf("kafkabroker: javac is not installed (the partitioning probe is compiled from java/PartitionProbe.java; apt-get install openjdk-17-jdk-headless): %w", err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(jars), "probe-build-")
	if err != nil {
		return "", fmt.Errorf("kafkabroker: %w", err)
	}
	defer os.RemoveAll(tmp)
	src := filepath.Join(tmp, "PartitionProbe.java")
	if err := os.WriteFile(src, probeSource, 0o644); err != nil {
		return "", fmt.Errorf("kafkabroker: %w", err)
	}
	out := filepath.Join(tmp, "classes")
	cmd := exec.CommandContext(ctx, javac, "-nowarn", "-cp", filepath.Join(jars, "*"), "-d", out, src)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("kafkabroker: javac PartitionProbe.java: %w\n%s", err, tail(b, 30))
	}
	// Another process may have compiled it meanwhile: either copy is good.
	if err := os.Rename(out, classes); err != nil && !fileExists(filepath.Join(classes, "PartitionProbe.class")) {
		return "", fmt.Errorf("kafkabroker: %w", err)
	}
	return classes, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
