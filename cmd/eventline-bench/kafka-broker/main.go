// Command kafka-broker runs one Apache Kafka broker (internal/kafkabroker)
// for development and for the real-broker test run. It is a developer tool
// of the repository, like eventline-bench, so it lives in this module,
// outside the library and the eventline command; unlike eventline-bench it
// uses an internal package of the library. From this directory:
//
//	go run ./kafka-broker [-port 9092] [-topics a,b]
//
// runs it in the foreground: its first line is KAFKA_BROKERS=127.0.0.1:9092,
// then its start-up time and memory; Ctrl-C stops it cleanly and removes
// its data (make kafka).
//
//	go run ./kafka-broker -port 0 -- command args...
//
// starts a broker, runs the command with KAFKA_BROKERS set to it, stops the
// broker and exits with the command's status (make test-kafka).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/eventline/eventline/internal/kafkabroker"
	"github.com/eventline/eventline/internal/kafkatest"
)

func main() {
	os.Exit(run())
}

func run() int {
	fs := flag.NewFlagSet("kafka-broker", flag.ContinueOnError)
	port := fs.Int("port", 9092, "client port on 127.0.0.1; 0 picks a free one")
	heap := fs.String("heap", kafkabroker.DefaultHeap, "the JVM's maximum heap (-Xmx)")
	topics := fs.String("topics", "", "comma-separated topics to create at start")
	partitions := fs.Int("partitions", 12, "partitions of each -topics topic")
	logLevel := fs.String("log-level", "WARN", "level of the broker's server.log (in its directory)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: kafka-broker [flags] [-- command args...]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(os.Args[1:]); err != nil {
		return 2
	}
	command := fs.Args()
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()

	if kafkabroker.Resolved() {
		fmt.Fprintf(os.Stderr, "kafka-broker: starting Apache Kafka %s\n", kafkabroker.KafkaVersion)
	} else {
		fmt.Fprintf(os.Stderr, "kafka-broker: resolving Apache Kafka %s with Maven (internal/kafkabroker/pom.xml, from Maven Central), then starting it\n", kafkabroker.KafkaVersion)
	}
	begin := time.Now()
	b, err := kafkabroker.Start(ctx, kafkabroker.Config{Port: *port, Heap: *heap, LogLevel: *logLevel})
	if err != nil {
		fmt.Fprintln(os.Stderr, "kafka-broker:", err)
		if *port != 0 && strings.Contains(err.Error(), "already in use") {
			fmt.Fprintf(os.Stderr, "kafka-broker: is port %d in use? pick another with -port, or -port 0 for a free one\n", *port)
		}
		return 1
	}
	defer func() {
		stopBegin := time.Now()
		if err := b.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "kafka-broker:", err)
		}
		fmt.Fprintf(os.Stderr, "kafka-broker: stopped in %s; %s removed\n", time.Since(stopBegin).Round(time.Millisecond), b.Dir())
	}()
	rss, _, _ := rss(b.Pid())
	fmt.Printf("KAFKA_BROKERS=%s\n", b.Addr())
	fmt.Fprintf(os.Stderr, "kafka-broker: Apache Kafka %s answering on %s (pid %d): started in %s (JVM %s), RSS %d MiB, heap max %s; data and server.log in %s\n",
		kafkabroker.KafkaVersion, b.Addr(), b.Pid(), time.Since(begin).Round(time.Millisecond), b.StartupTime().Round(time.Millisecond),
		rss>>20, *heap, b.Dir())
	if *topics != "" {
		names := strings.FieldsFunc(*topics, func(r rune) bool { return r == ',' || r == ' ' })
		if _, err := kafkatest.CreateTopics(ctx, []string{b.Addr()}, int32(*partitions), nil, names...); err != nil {
			fmt.Fprintln(os.Stderr, "kafka-broker:", err)
			return 1
		}
		fmt.Fprintf(os.Stderr, "kafka-broker: topics %s created (%d partitions each)\n", strings.Join(names, ", "), *partitions)
	}
	if len(command) == 0 {
		fmt.Fprintln(os.Stderr, "kafka-broker: interrupt (Ctrl-C) to stop it")
		select {
		case <-ctx.Done():
		case <-b.Exited():
			fmt.Fprintf(os.Stderr, "kafka-broker: the broker exited on its own; its logs:\n%s", b.LogTail(40))
			return 1
		}
		return 0
	}
	return runCommand(ctx, b, command)
}

// runCommand runs command with KAFKA_BROKERS set to the broker and returns
// its exit status.
func runCommand(ctx context.Context, b *kafkabroker.Broker, command []string) int {
	cmd := exec.Command(command[0], command[1:]...)
	cmd.Env = append(os.Environ(), "KAFKA_BROKERS="+b.Addr())
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	begin := time.Now()
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "kafka-broker:", err)
		return 1
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	var err error
	select {
	case err = <-waited:
	case <-ctx.Done():
		_ = cmd.Process.Signal(syscall.SIGTERM)
		err = <-waited
	}
	rss, peak, _ := rss(b.Pid())
	fmt.Fprintf(os.Stderr, "kafka-broker: %s finished after %s; broker RSS %d MiB (peak %d MiB)\n",
		command[0], time.Since(begin).Round(time.Second), rss>>20, peak>>20)
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		if !b.Running() {
			fmt.Fprintf(os.Stderr, "kafka-broker: the broker exited during the run; its logs:\n%s", b.LogTail(40))
		}
		return max(ee.ExitCode(), 1)
	default:
		fmt.Fprintln(os.Stderr, "kafka-broker:", err)
		return 1
	}
}

// rss returns a process's resident memory now, and its peak, in bytes.
func rss(pid int) (now, peak int64, err error) {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, fmt.Errorf("read the memory of process %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(st), "\n") {
		name, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(val)
		if len(f) != 2 || f[1] != "kB" {
			continue
		}
		kb, _ := strconv.ParseInt(f[0], 10, 64)
		switch name {
		case "VmRSS":
			now = kb << 10
		case "VmHWM":
			peak = kb << 10
		}
	}
	return now, peak, nil
}
