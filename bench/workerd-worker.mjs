// The Worker bench/workerd.ts measures: ?mode=module (a Pool at module scope) or ?mode=request (a
// Client made, connected and ended in each request). Bindings: PROXY, DATABASE_URL.
import { env } from 'cloudflare:workers'
import { Client, Pool } from '../dist/index.mjs'

const wsProxy = () => env.PROXY
const pool = new Pool({ connectionString: env.DATABASE_URL, wsProxy })

export default {
  async fetch(request, _env, ctx) {
    const mode = new URL(request.url).searchParams.get('mode')
    if (mode === 'module') return Response.json((await pool.query('SELECT 1 AS one')).rows)
    const client = new Client({ connectionString: env.DATABASE_URL, wsProxy })
    await client.connect()
    const { rows } = await client.query('SELECT 1 AS one')
    ctx.waitUntil(client.end())
    return Response.json(rows)
  },
}
