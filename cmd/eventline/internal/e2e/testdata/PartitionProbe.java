import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.Future;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * Produces one record per key read from stdin (one key a line) to a topic
 * with Apache Kafka's Java producer and its default partitioning (no
 * partitioner configured: a keyed record goes to murmur2(key) mod the
 * topic's partition count), then prints, for each key in input order, the
 * partition and offset the broker acknowledged: "key TAB partition TAB
 * offset".
 *
 * Usage: java -cp 'jars/*:classes' PartitionProbe bootstrap topic < keys
 *
 * TestJavaClientAgreesOnPartitions (broker_partition_test.go) compares
 * these partitions with the ones eventline's relay picks for the same keys.
 */
public final class PartitionProbe {
    public static void main(String[] args) throws Exception {
        if (args.length != 2) {
            System.err.println("usage: PartitionProbe bootstrap-servers topic < keys");
            System.exit(2);
        }
        List<String> keys = new ArrayList<>();
        try (BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8))) {
            for (String line; (line = in.readLine()) != null; ) {
                if (!line.isEmpty()) {
                    keys.add(line);
                }
            }
        }
        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        props.put(ProducerConfig.CLIENT_ID_CONFIG, "eventline-partition-probe");
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        props.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        props.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        List<Future<RecordMetadata>> acks = new ArrayList<>(keys.size());
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(props)) {
            for (String key : keys) {
                acks.add(producer.send(new ProducerRecord<>(args[1], key, "probe")));
            }
            producer.flush();
            StringBuilder out = new StringBuilder();
            for (int i = 0; i < keys.size(); i++) {
                RecordMetadata md = acks.get(i).get();
                out.append(keys.get(i)).append('\t').append(md.partition()).append('\t').append(md.offset()).append('\n');
            }
            System.out.print(out);
            System.out.flush();
        }
    }
}
