// Only re-exports: an app that imports `httpSql` alone leaves the whole WebSocket driver (and pg's
// Client) out of its bundle, since nothing here runs on import.
import { Client, Pool, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral } from './client'
import { config } from './config'

export { Client, Pool, config, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral }
export type { ClientConfig, PoolConfig } from './client'
export type { EdgeConfig, WebSocketConstructor } from './config'
import type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification } from 'pg'
export type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification }

export { httpSql, HttpQuery, HttpSqlError } from './http'
export type { HttpSql, HttpQueryFunction, HttpSqlOptions, HttpQueryOptions, HttpTransactionOptions, HttpTransportOptions, HttpQueryResult, HttpPoolConfig, HttpTypes, IsolationLevel } from './http'

export default { Client, Pool, config, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral }
