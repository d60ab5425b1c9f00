/**
 * `edgepg-proxy token`: a token for trying tokens out, signed with the proxy's own
 * --jwt-secret-file (HS256), for the audience, issuer and role claim the proxy checks. Your app's
 * identity provider signs the real ones.
 */
import { SignJWT } from 'jose'

export interface Mint {
  secret: Uint8Array
  audience: string
  issuer?: string
  roleClaim: string
  role: string
  /** Further claims (`sub`, those the database's policies read). */
  claims: Record<string, unknown>
  ttlSeconds: number
}

export function mintToken(o: Mint): Promise<string> {
  const jwt = new SignJWT({ ...o.claims, [o.roleClaim]: o.role })
    .setProtectedHeader({ alg: 'HS256', typ: 'JWT' })
    .setAudience(o.audience)
    .setIssuedAt()
    .setExpirationTime(Math.floor(Date.now() / 1000) + o.ttlSeconds)
  if (o.issuer) jwt.setIssuer(o.issuer)
  return jwt.sign(o.secret)
}
