import pg from 'pg'
import { Client, Pool } from './client'
import { config } from './config'

export { Client, Pool, config }
export type { ClientConfig, PoolConfig } from './client'
export type { EdgeConfig, WebSocketConstructor } from './config'
import type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification } from 'pg'
export type { QueryResult, QueryResultRow, FieldDef, PoolClient, QueryConfig, Notification }

export const { types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral } = pg

export default { Client, Pool, config, types, defaults, DatabaseError, Query, escapeIdentifier, escapeLiteral }
