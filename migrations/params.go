package migrations

import wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

func wsqlSchemaParams(topic string) wsql.SchemaInitializingQueriesParams {
	return wsql.SchemaInitializingQueriesParams{Topic: topic}
}

func wsqlOffsetsParams(topic string) wsql.OffsetsSchemaInitializingQueriesParams {
	return wsql.OffsetsSchemaInitializingQueriesParams{Topic: topic}
}
